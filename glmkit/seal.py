"""Sealed reports: what a notebook displayed becomes HTML only through an allow-list sanitiser (nh3,
the Rust `ammonia` library), and the page forbids every network request with its own
Content-Security-Policy.

Kept from notebook output: text structure (paragraphs, headings, lists, tables, code), links a reader
may click (http, https, in-page anchors; opened with noopener), images whose source is inline
(`data:image/...`), and inline styles limited to layout and colour properties (no property that can
take a url()). Everything else goes: scripts and event handlers, frames, objects, embeds, media,
forms, `<base>`, `<link>`, `<meta>` (so no refresh), `<style>` blocks, `srcset`, SVG, relative and
non-http URLs. The CSP is the second wall: it allows images and fonts from data: URIs and the page's
own inline styles, and nothing else (no script, no connection, no frame, no form target, no base URI).
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

CSP = ("default-src 'none'; img-src data:; font-src data:; style-src 'unsafe-inline'; script-src 'none'; "
       "connect-src 'none'; frame-src 'none'; object-src 'none'; media-src 'none'; base-uri 'none'; "
       "form-action 'none'")
CSP_META = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'

TAGS = {"a", "abbr", "b", "blockquote", "br", "caption", "cite", "code", "col", "colgroup", "dd", "del", "details",
        "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "img", "ins",
        "kbd", "li", "mark", "ol", "p", "pre", "q", "s", "samp", "small", "span", "strong", "sub", "summary", "sup",
        "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var"}
COMMON = {"title", "class", "style", "align"}
ATTRIBUTES = {"*": COMMON, "a": {"href"}, "img": {"src", "alt", "width", "height"},
              "td": {"colspan", "rowspan"}, "th": {"colspan", "rowspan", "scope"}, "ol": {"start"}}
# CSS properties that cannot fetch anything (no url(), no image, no font face)
STYLE_PROPERTIES = {"color", "background-color", "text-align", "vertical-align", "font-weight", "font-style",
                    "font-size", "font-family", "white-space", "border", "border-collapse", "border-color",
                    "border-width", "border-style", "padding", "padding-left", "padding-right", "padding-top",
                    "padding-bottom", "margin", "margin-left", "margin-right", "margin-top", "margin-bottom",
                    "width", "height", "max-width", "max-height", "min-width", "display", "text-decoration",
                    "line-height", "overflow", "overflow-x"}
_INLINE_IMAGE = re.compile(r"data:image/(png|jpeg|gif|webp);base64,[A-Za-z0-9+/=\s]*\Z", re.IGNORECASE)
_LINK = re.compile(r"(https?://|#)", re.IGNORECASE)


def _attribute(element: str, attribute: str, value: str):
    """nh3's per-attribute hook: URLs only where they cannot fetch on their own."""
    if attribute == "src":
        return value if element == "img" and _INLINE_IMAGE.match(value.strip()) else None
    if attribute == "href":
        return value if element == "a" and _LINK.match(value.strip()) else None
    if attribute == "style":
        # nh3 keeps an allowed property whatever its value: `background-color: url(http://...)` (or
        # `u\72l(...)`) would fetch. Such declarations go (no allowed property takes an image), the rest
        # stays for nh3's own filter.
        kept = [d for d in value.split(";") if not _FETCHES.search(_css_unescaped(d))]
        return ";".join(kept) if any(d.strip() for d in kept) else None
    return value


_FETCHES = re.compile(r"\b(?:url|image-set|src)\s*\(", re.IGNORECASE)
_CSS_ESCAPE = re.compile(r"\\(?:([0-9a-fA-F]{1,6})\s?|(.))", re.DOTALL)


def _css_unescaped(text: str) -> str:
    """CSS text with its backslash escapes read (`u\\72l` is `url`), as a browser reads it."""
    def one(found):
        if found.group(1) is None:
            return found.group(2)
        code = int(found.group(1), 16)
        return chr(code) if 0 < code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF else "\ufffd"
    return _CSS_ESCAPE.sub(one, text)


# The sanitiser's time grows with the square of the elements' nesting (20,000 nested <div>: 2.5 s; 200,000:
# minutes, deaf to signals): deeper output is shown as its escaped text. Browsers stop nesting near 512.
MAX_HTML_DEPTH = 512
_TAG = re.compile(r"<(/?)([a-zA-Z][^\s/>]*)[^>]*?(/?)>")
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"})


def html_depth(fragment: str) -> int:
    """The deepest nesting of elements in `fragment`, counted in one pass over its tags (an upper bound:
    unclosed elements count as open)."""
    depth = deepest = 0
    for closing, name, self_closing in _TAG.findall(fragment):
        if closing:
            depth = max(0, depth - 1)
        elif not self_closing and name.lower() not in _VOID:
            depth += 1
            deepest = max(deepest, depth)
    return deepest


def sanitize_html(fragment: str) -> str:
    """A notebook output's HTML -> the same with only what the allow-list keeps; nested deeper than
    MAX_HTML_DEPTH, its escaped text (nothing of it is markup)."""
    import html
    import nh3

    if (depth := html_depth(fragment)) > MAX_HTML_DEPTH:
        return (f"<p><i>HTML nested {depth} elements deep (over {MAX_HTML_DEPTH}), shown as text</i></p>"
                f"<pre>{html.escape(fragment)}</pre>")
    cleaned = nh3.clean(fragment, tags=TAGS, attributes=ATTRIBUTES, attribute_filter=_attribute,
                        url_schemes={"http", "https", "data"}, filter_style_properties=STYLE_PROPERTIES,
                        clean_content_tags={"script", "style"}, link_rel="noopener noreferrer nofollow",
                        strip_comments=True)
    return cleaned


class _FirstHead(HTMLParser):
    """Where the first real <head> start tag ends (a "<head>" inside a comment, a script or an
    attribute value is not one)."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.end = None

    def handle_starttag(self, tag, attrs):
        if tag == "head" and self.end is None:
            line, column = self.getpos()
            self.end = (line, column + len(self.get_starttag_text()))


def with_csp(page: str) -> str:
    """The page with its Content-Security-Policy as the first element of <head> (before anything a
    browser could fetch)."""
    finder = _FirstHead()
    finder.feed(page)
    finder.close()
    if finder.end is None:
        return f"<head>{CSP_META}</head>" + page
    line, column = finder.end
    at = sum(len(text) + 1 for text in page.split("\n")[:line - 1]) + column  # the parser counts "\n" only
    return page[:at] + CSP_META + page[at:]
