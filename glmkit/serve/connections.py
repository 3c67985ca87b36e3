"""Connection bounds for `glmkit serve` that uvicorn does not give: a deadline for a request's headers and
a cap on open connections.

uvicorn's h11 protocol waits for ever for headers that never end (a client sending one byte a minute, or
nothing after connecting), so enough such connections exhaust the process's file descriptors and the
server stops accepting the framework's requests. Each connection here must finish a request's headers
within `header_timeout_s` of its first byte (or of connecting), and connections beyond `max_connections`
are answered 503 and closed at once. Idle keep-alive connections stay governed by uvicorn's own
keep-alive timeout."""

from __future__ import annotations

import os
import re
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

FD_RESERVE = 32  # descriptors kept free beyond those open now: weight-update reads, logs, a traceback file
MAX_HEADER_BYTES = 64 * 1024  # a request line and headers still incomplete past this are refused (431)
LINGER_S, LINGER_BYTES = 2.0, 64 << 20  # after refusing a request, what of it is still read and dropped


def _closing_answer(status: int, reason: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


_REQUEST_LINE = re.compile(rb"[!-~]+ [!-~]+ HTTP/(\d+(?:\.\d+)?)\r?\n")


def _other_http_version(head: bytes) -> str | None:
    """The HTTP version a request line asks for when it is not 1.x (h11 parses `PRI * HTTP/2.0`, an
    HTTP/2 client's preface, or `GET / HTTP/3.0` as requests and would route them); None otherwise,
    or while the line is still incomplete."""
    found = _REQUEST_LINE.match(head)
    if found is None or found.group(1).split(b".")[0] == b"1":
        return None
    return found.group(1).decode()


def open_descriptors() -> int:
    """How many descriptors this process holds now (the model's files, the listening socket, threads' pipes)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): a generous guess
        return 128


def connection_cap(wanted: int) -> int:
    """The most connections this process can hold open: `wanted`, after raising the soft descriptor
    limit toward it where the hard limit allows; never more than the limit leaves room for beside the
    descriptors open now and a reserve. 0 when the limit leaves no room at all."""
    margin = open_descriptors() + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + margin
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(0, min(wanted, soft - margin))


def bounded_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a connection cap (pass as `uvicorn.Config(http=...)`)."""

    class BoundedH11Protocol(H11Protocol):
        _header_timer = None
        _lingering = None  # bytes dropped since a refusal; None while the connection serves
        _parse_error = None  # h11's error for the request (uvicorn passes on only a generic line)
        _line_checked = False  # whether this request's first line was looked at for its HTTP version

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            next_event = self.conn.next_event

            def next_event_recorded():
                try:
                    return next_event()
                except h11.RemoteProtocolError as err:
                    self._parse_error = err
                    raise

            self.conn.next_event = next_event_recorded
            if len(self.connections) > max_connections:
                transport.write(_closing_answer(503, "Service Unavailable",
                                                f"the server holds its limit of {max_connections} open connections; "
                                                f"retry later\n"))
                transport.close()
                return
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            if self._lingering is not None:  # a refused request's rest: dropped, up to a bound
                self._lingering += len(data)
                if self._lingering > LINGER_BYTES:
                    self.transport.close()
                return
            if self.conn.their_state is h11.IDLE and not self._line_checked:
                head = bytes(getattr(self.conn, "_receive_buffer", b"")) + data
                self._line_checked = b"\n" in head  # once the line is whole (a request's, not each packet's)
                if (version := _other_http_version(head)) is not None:
                    self._refuse(_closing_answer(505, "HTTP Version Not Supported",
                                                 f"HTTP/{version} is not served here: this server speaks HTTP/1.1 "
                                                 f"(as SGLang's does)\n"))
                    return
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:  # headers begun but not finished, or a new request on keep-alive
                if self._header_timer is None and self.timeout_keep_alive_task is None:
                    self._arm_header_deadline()
            else:  # a request's headers are in: its body has its own timeout (the app's)
                self._disarm_header_deadline()

        def connection_lost(self, exc) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers a request h11 cannot parse with a bare 400 and closes at once: a client still
            # sending its over-long headers then got a connection reset instead of the answer. The answer
            # here says which limit, and the connection lingers (the rest read and dropped) before closing.
            if getattr(self._parse_error, "error_status_hint", None) == 431:  # h11's own "buffer too long"
                answer = _closing_answer(431, "Request Header Fields Too Large",
                                         f"the request line and headers exceed {MAX_HEADER_BYTES} bytes\n")
            else:
                answer = _closing_answer(400, "Bad Request", f"a malformed HTTP/1.1 request: {self._parse_error or msg}\n")
            self._refuse(answer)

        def _refuse(self, answer: bytes) -> None:
            self._disarm_header_deadline()
            self.transport.write(answer)
            self._linger()

        def _linger(self) -> None:
            self._lingering = 0
            try:
                self.transport.write_eof()  # the answer is whole: the client reads it while still sending
            except (NotImplementedError, OSError, RuntimeError):
                pass
            self.loop.call_later(LINGER_S, self.transport.close)

        def on_response_complete(self) -> None:
            self._disarm_header_deadline()
            if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
                # answered before the request's body ended (a 408, a 413, or a route that reads no body):
                # the rest of that body would hold the connection with no timer armed, so it is closed
                self.transport.close()
                return
            self._line_checked = False  # the next request on this connection has its own first line
            super().on_response_complete()

        def _arm_header_deadline(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self.transport.write(_closing_answer(408, "Request Timeout",
                                                 f"the request's headers did not arrive within {header_timeout_s:g} s "
                                                 f"(--header-timeout-s)\n"))
            self.transport.close()

    return BoundedH11Protocol
