"""Per-request sampling with SGLang's semantics, for requests sharing one batch of cache slots.

Each request keeps its own settings (`protocol.Sampling`), its own random stream and its own stop
rules, so requests with different settings decode in the same steps and a request's tokens do not
depend on what else is in the batch (a request with `sampling_seed` gives the same tokens alone or
batched).

Per step and row, in SGLang's order: logit_bias added; frequency / presence / repetition penalties
over the tokens this request generated; stop ids (stop_token_ids and EOS) masked while fewer than
min_new_tokens are out; logits / temperature; log-softmax (the reported log-prob, untruncated); then
top_k, top_p and min_p cut the sorted distribution and one token is drawn by inverse CDF from a
uniform of the request's own generator. Greedy (temperature < 1e-6, or top_k 1) takes the argmax,
its log-prob from the plain softmax (SGLang samples it as temperature 1, top_k 1).

Stops, checked after each token as SGLang's `update_finish_state`: a stop string in the decoded tail
(`{"matched": the string}`), else, unless `ignore_eos`, a stop id or the model's EOS (`{"matched":
the id}`); both stay in output_ids.
"""

from __future__ import annotations

import torch

from glmkit.serve.protocol import Sampling


class RequestState:
    """What one request carries between steps: settings, random stream, penalty counts, stop rules."""

    def __init__(self, sampling: Sampling, seed: int, eos_ids, stop_window: int = 0, top_logprobs: int = 0):
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed % (1 << 64))
        self.stop_ids = set() if sampling.ignore_eos else set(sampling.stop_token_ids) | set(eos_ids)
        # min_new_tokens blocks every stop id, ignore_eos or not (SGLang's MinNewTokens penalizer)
        self.min_blocked = sorted(set(sampling.stop_token_ids) | set(eos_ids))
        self.stop_window = stop_window
        self.top_logprobs = top_logprobs
        self.prior = []  # tokens generated before a retraction (the request goes on from them)
        self.counts = None  # [V] token counts of the output, for the penalties
        self.top = []  # per output token: [[logprob, id], ...] when top_logprobs > 0
        self.matched = None


LOGIT_CLAMP = 1e30  # a biased or penalised logit is clamped here, so no row turns inf / NaN


class RequestSampler:
    """`SlotBatch`'s sampler: `choose` draws one token per row, `finish` says whether a request ends."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @torch.no_grad()
    def choose(self, logits: torch.Tensor, states: list, outputs: list) -> tuple[list, list]:
        """logits [R, V] of the rows, their RequestStates and output token lists -> (tokens, log-probs)."""
        logits = logits.float().clone()
        rows, vocab = logits.shape
        # the model's own row is not finite, or past the clamp below (weights that overflow): a token is
        # still drawn (from the clamped row), but its log-probs are NaN, answered as null, never made up
        # from the ties the clamp leaves (log(1/V), or log(1/#ties))
        broken = ~(torch.isfinite(logits) & (logits.abs() <= LOGIT_CLAMP)).all(-1)
        for i, (st, out) in enumerate(zip(states, outputs)):
            s = st.sampling
            for token, bias in s.logit_bias:
                logits[i, token] += bias
            if s.penalised and st.counts is not None:
                counts = st.counts.to(logits.device)
                seen = counts > 0
                logits[i] -= s.frequency_penalty * counts + s.presence_penalty * seen.float()
                if s.repetition_penalty != 1:
                    row = logits[i]
                    logits[i] = torch.where(seen, torch.where(row > 0, row / s.repetition_penalty,
                                                              row * s.repetition_penalty), row)
            if len(st.prior) + len(out) < s.min_new_tokens and st.min_blocked:
                logits[i, st.min_blocked] = float("-inf")
        # a huge bias or penalty must not turn a row into inf / NaN (nor fail the rows batched with it)
        logits = logits.nan_to_num(nan=-LOGIT_CLAMP, posinf=LOGIT_CLAMP, neginf=-LOGIT_CLAMP).clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
        temps = torch.tensor([1.0 if st.sampling.greedy else st.sampling.temperature for st in states],
                             device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], -1)
        tokens = logp.argmax(-1)
        drawn = [i for i, st in enumerate(states) if not st.sampling.greedy]
        if drawn:
            tokens[drawn] = self._draw(logp[drawn], [states[i] for i in drawn])
        picked = logp.gather(-1, tokens[:, None])[:, 0].masked_fill(broken, float("nan"))
        host = torch.stack([tokens.double(), picked.double(), broken.double()]).cpu()
        tokens_out, logprobs_out = [int(t) for t in host[0].tolist()], host[1].tolist()
        for i, st in enumerate(states):
            if st.top_logprobs:
                values, ids = logp[i].topk(min(st.top_logprobs, vocab))
                st.top.append([[float("nan") if host[2, i] else float(v), int(t)]
                               for v, t in zip(values.tolist(), ids.tolist())])
            if st.sampling.penalised:
                if st.counts is None:
                    st.counts = torch.zeros(vocab, device=logits.device)
                st.counts[tokens_out[i]] += 1
        return tokens_out, logprobs_out

    @staticmethod
    def _draw(logp: torch.Tensor, states: list) -> torch.Tensor:
        """One token per row from softmax(logp) cut by each row's top_k, top_p and min_p."""
        probs, order = logp.exp().sort(-1, descending=True)
        rank = torch.arange(probs.shape[1], device=probs.device)
        top_k = torch.tensor([min(st.sampling.top_k, probs.shape[1]) for st in states], device=probs.device)
        top_p = torch.tensor([st.sampling.top_p for st in states], device=probs.device)
        min_p = torch.tensor([st.sampling.min_p for st in states], device=probs.device)
        keep = rank[None, :] < top_k[:, None]
        keep &= (probs.cumsum(-1) - probs) < top_p[:, None]  # the first token is always kept
        keep &= probs >= min_p[:, None] * probs[:, :1]
        kept = probs * keep
        uniform = torch.tensor([float(torch.rand(1, generator=st.generator)) for st in states],
                               dtype=kept.dtype, device=kept.device)
        cdf = kept.cumsum(-1)
        at = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
        at = torch.minimum(at, (keep.sum(-1) - 1).clamp_min(0))  # every cut drops a suffix of the sorted order
        return order.gather(-1, at[:, None])[:, 0]

    def finish(self, st: RequestState, out: list) -> bool:
        """Whether the request ends on its last token (a stop string, a stop id or EOS); sets st.matched."""
        s = st.sampling
        out = st.prior + out if st.prior else out
        if s.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(out[-st.stop_window:])
            for stop in s.stop:
                if stop in tail:
                    st.matched = stop
                    return True
        if out[-1] in st.stop_ids:
            st.matched = out[-1]
            return True
        return False

    def stop_window(self, sampling: Sampling) -> int:
        """How many output tokens to decode to see any of the stop strings complete."""
        if not sampling.stop or self.tokenizer is None:
            return 0
        return 2 + max(len(self.tokenizer.encode(s, add_special_tokens=False)) for s in sampling.stop)
