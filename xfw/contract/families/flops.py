"""Training FLOPs as a ledger: every matrix product one sample's training step makes, term by term.

A family lists the products its model computes for one sample (``flop_ledger(arch, trained, lora,
recompute)`` in its module, ``trained`` the parts that train) as :class:`Matmul` entries; :func:`tally` sums them into model FLOPs
per term (the family's parts, plus ``lora`` for the adapters) and, separately, the forward work
activation recomputation repeats (hardware FLOPs)::

    >>> layer = [linear("text", 64, 64, 64, trains=True, grad_in=True)]   # 64 tokens, a 64x64 linear
    >>> tally(layer).model                                                # forward + 2 gradients
    1572864.0

Conventions, those of ``torch.utils.flop_counter`` (tests/contract/test_flop_counter.py holds
every family to it): matrix products only (linears, batched matmuls, convolutions, attention's
two products), 2 FLOPs per multiply-add, attention counted whole (no causal discount, as PaLM's
6N + 12LHQT: Chowdhery et al. 2022, appendix B). The backward costs one more forward's worth per
operand that needs a gradient, which is what autograd computes:

* a linear or convolution: its weight's gradient if the weight trains, its input's gradient if a
  gradient must reach the input (something upstream of it trains). So a trained layer fed by a
  trained one costs 3x its forward, a trained first layer (fed by data) 2x, a frozen layer that
  gradients cross 2x, and a frozen part nothing upstream of trains (a vision tower, a VAE) 1x;
* attention's products Q·Kᵀ and P·V: both operands of each, when a gradient flows at all (3x).

Recompute (activation checkpointing) runs the forward of every checkpointed unit a gradient
passes through a second time, in backward. That is hardware FLOPs, not model FLOPs (PaLM's
distinction): :attr:`FlopCount.recompute` holds it apart and MFU never counts it. The rerun stops
early (``torch.utils.checkpoint``'s default): once the last tensor the unit saved for backward is
back, the rest of its forward is skipped, and an op saves its inputs before it runs, so a unit
ending in a product (a decoder layer's down_proj, a ResnetBlock2D's last convolution, a
BasicTransformerBlock's feed-forward output) never reruns that product (``ends_unit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

LORA_TERM = "lora"
"""The term of LoRA adapters' products (they train; the linear they adapt stays in its part)."""


@dataclass(frozen=True, slots=True)
class Matmul:
    """One matrix product of one sample's step."""

    term: str
    """The part it belongs to (a family ``PARTS`` key, or :data:`LORA_TERM`)."""
    forward: float
    """Forward FLOPs for one sample (2 per multiply-add)."""
    grads: int = 0
    """Operands that need a gradient in backward (0, 1 or 2): each costs one more ``forward``."""
    recomputed: bool = False
    """Inside a checkpointed unit the backward passes through: its forward runs twice."""


@dataclass(frozen=True, kw_only=True)
class FlopCount:
    """One sample's training FLOPs by term: model FLOPs, and the recomputation on top."""

    terms: dict[str, float] = field(default_factory=dict)
    """Model FLOPs (forward and backward) per term."""
    recompute: dict[str, float] = field(default_factory=dict)
    """Forward FLOPs recomputation repeats, per term; hardware only."""

    @property
    def model(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def hardware(self) -> float:
        return self.model + float(sum(self.recompute.values()))


def tally(ledger: list[Matmul]) -> FlopCount:
    terms: dict[str, float] = {}
    recompute: dict[str, float] = {}
    for m in ledger:
        terms[m.term] = terms.get(m.term, 0.0) + m.forward * (1 + m.grads)
        if m.recomputed:
            recompute[m.term] = recompute.get(m.term, 0.0) + m.forward
    return FlopCount(terms=terms, recompute={k: v for k, v in recompute.items() if v})


def linear(term: str, tokens: int, n_in: int, n_out: int, *, trains: bool, grad_in: bool,
           recomputed: bool = False) -> Matmul:
    """A linear layer applied to ``tokens`` tokens."""
    return Matmul(term, 2.0 * tokens * n_in * n_out, int(trains) + int(grad_in), recomputed)


def conv(term: str, out_pixels: int, kernel: int, c_in: int, c_out: int, *, trains: bool, grad_in: bool,
         recomputed: bool = False) -> Matmul:
    """A convolution: ``kernel`` taps (k x k, or t x k x k) per output pixel and channel pair."""
    return Matmul(term, 2.0 * out_pixels * kernel * c_in * c_out, int(trains) + int(grad_in), recomputed)


def attention(term: str, q_tokens: int, kv_tokens: int, width: int, *, grad: bool,
              recomputed: bool = False) -> Matmul:
    """Q·Kᵀ and P·V over all heads (``width`` = heads x head size), no causal discount."""
    return Matmul(term, 4.0 * q_tokens * kv_tokens * width, 2 if grad else 0, recomputed)


def adapted(term: str, tokens: int, n_in: int, n_out: int, *, trains: bool, grad_in: bool, lora_r: int | None,
            recomputed: bool = False, ends_unit: bool = False) -> list[Matmul]:
    """A linear and, when ``lora_r``, its LoRA adapters (peft's: the linear, then ``B(A(x))`` added;
    A's input gradient only if ``grad_in``, B's always: A trains). ``ends_unit``: the last product
    here ends a checkpointed unit, so recompute skips it (module docstring)."""
    out = [linear(term, tokens, n_in, n_out, trains=trains, grad_in=grad_in,
                  recomputed=recomputed and (bool(lora_r) or not ends_unit))]
    if lora_r:
        out += [linear(LORA_TERM, tokens, n_in, lora_r, trains=True, grad_in=grad_in, recomputed=recomputed),
                linear(LORA_TERM, tokens, lora_r, n_out, trains=True, grad_in=True,
                       recomputed=recomputed and not ends_unit)]
    return out


def lora_rank(lora: dict | None, name: str) -> int | None:
    """The adapters' rank on a linear named ``name`` (None: not a target, or no LoRA)."""
    return lora["r"] if lora and name in lora["targets"] else None
