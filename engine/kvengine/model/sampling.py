"""Pick one token per request from its logits row (vLLM's sampler, minus penalties).

- temperature < 1e-5: greedy (argmax), as vLLM's _SAMPLING_EPS;
- else logits / temperature, then top-k (0 = off), then top-p (1.0 = off;
  the most likely token always stays), then a draw.
- A draw is vLLM's exponential race: argmax(probs / E) with E ~ Exp(1), the
  noise of a request with a `seed` from its own torch.Generator (so its
  tokens do not depend on what else is in the batch), the others' from the
  executor's generator.
eos, stop token ids, ignore_eos and max_tokens are the scheduler's business
(scheduler.update_from_output); the sampler only picks.
"""
from __future__ import annotations

import torch

from kvengine.core.request import Request, SamplingParams

SAMPLING_EPS = 1e-5


def is_greedy(sp: SamplingParams) -> bool:
    return sp.temperature < SAMPLING_EPS


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k / top-p cut, row by row ([S, V] float32, in place)."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cut = torch.zeros_like(sorted_logits, dtype=torch.bool)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    if top_k is not None:  # k <= 0 means off
        k = torch.where(top_k > 0, top_k, logits.shape[-1])
        cut |= ranks[None, :] >= k[:, None]
    if top_p is not None:
        probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        cut |= before > top_p[:, None]
        cut[:, 0] = False
    sorted_logits.masked_fill_(cut, float("-inf"))
    return logits.scatter_(-1, order, sorted_logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first of equal maxima, as torch's). On the CPU through numpy:
    torch's CPU argmax over a 32000-wide row is ~12x slower (0.56 ms against
    0.045 ms for 32 rows), a tenth of a tiny-model decode step."""
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.seeded: dict[str, tuple[Request, torch.Generator]] = {}

    def _request_generator(self, req: Request) -> torch.Generator:
        entry = self.seeded.get(req.request_id)
        if entry is None or entry[0] is not req:
            # torch takes [-2**63, 2**64); a negative seed means the same as its 64-bit pattern
            gen = torch.Generator(self.device).manual_seed(req.sampling_params.seed & 0xFFFF_FFFF_FFFF_FFFF)
            entry = self.seeded[req.request_id] = (req, gen)
        return entry[1]

    def forget_finished(self) -> None:
        for rid in [rid for rid, (req, _) in self.seeded.items() if req.is_finished]:
            del self.seeded[rid]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits [S, V] float32, one row per request; the chosen ids."""
        params = [r.sampling_params for r in requests]
        greedy = [is_greedy(sp) for sp in params]
        if all(greedy):
            return argmax(logits).tolist()
        out = argmax(logits)
        rows = [i for i, g in enumerate(greedy) if not g]
        idx = torch.tensor(rows, device=logits.device)
        x = logits[idx]
        temps = torch.tensor([params[i].temperature for i in rows], device=x.device)
        x.div_(temps[:, None])
        top_k = [min(params[i].top_k, x.shape[-1]) for i in rows]  # k >= vocab keeps all: an int64 always
        top_p = [params[i].top_p for i in rows]
        x = apply_top_k_top_p(
            x,
            torch.tensor(top_k, device=x.device) if any(k > 0 for k in top_k) else None,
            torch.tensor(top_p, device=x.device) if any(p < 1.0 for p in top_p) else None)
        probs = x.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if params[i].seed is None]
        if unseeded:
            part = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            noise[unseeded] = exponential_(part, self.generator)
        for j, i in enumerate(rows):
            if params[i].seed is not None:
                exponential_(noise[j], self._request_generator(requests[i]))
        out[idx] = (probs / noise).argmax(dim=-1)
        if len(self.seeded) > 64:
            self.forget_finished()
        return out.tolist()


def exponential_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill `t` in place with Exp(1) samples as -log(U), U ~ Uniform[0, 1): the same law as
    Tensor.exponential_, which on a CPU takes 5x longer (1.4 ms for 3 x 32000 rows, a third
    of a small decode step, against 0.29 ms here)."""
    return t.uniform_(generator=generator).log_().neg_()
