"""Exact gradient accumulation: a step's gradient that does not depend on the order of its contributions.

Why: fp32 addition is not associative, and Adam divides by the root of the second moment,
so the rounding noise of an arrival-order sum on a parameter whose true gradient is ~0
(e.g. ``k_proj.bias``: softmax is shift-invariant) becomes an update of about ``lr``
(issue 22: 7.5e-4 relative between sync and async runs of one job after 4 steps).

How: every contribution (the fp32 gradient of one GRPO group) is converted *exactly* to a
fixed-point integer on the grid ``2**-GRID_BITS`` (truncated toward zero below the grid)
and added into two int64 limbs per element. Integer addition is associative, so the limbs
are a function of the *multiset* of contributions: any arrival order, any cut into
micro-batches, any split over data-parallel ranks (the limbs are all-reduced, an exact
integer sum) and any replay give the same limbs, hence the same fp32 gradient bytes.

Representation of one contribution ``x`` (an fp32 element): ``X = trunc(|x| * 2**GRID_BITS)``
as a conceptually 88-bit integer, split into ``lo = X mod 2**LIMB_BITS`` and
``hi = X >> LIMB_BITS``; the limbs accumulate ``sign(x) * lo`` and ``sign(x) * hi``. Range and
precision:

* ``|x| < 2**MAX_EXPONENT`` (6.9e10) per contribution, else :class:`GradientOutOfRange`;
* at most ``MAX_CONTRIBUTIONS`` (32768) contributions per step over all ranks (int64 headroom
  of the ``hi`` limb);
* absolute resolution ``2**-52`` (2.2e-16): elements with ``|sum| >= 2**-28`` (3.7e-9) keep full
  fp32 precision; smaller ones are exact to 2.2e-16 (the un-normalised gradient of a loss sum;
  the step normaliser ``1/N`` divides it further).

Non-finite contributions (inf, nan) go to a separate fp32 sum, allocated on first use; a sum of
values from {0, +inf, -inf, nan} is order-independent (nan if any nan or both infinities), and
wherever it is non-zero it replaces the element.

Cost: 16 bytes per trainable element (the limbs), resident from the first contribution of a step
until the engine is released, plus chunked temporaries; see ``benchmarks/exact_accumulation.py``
and docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexmarl.errors import FailedPrecondition

#: Contributions are integers in units of 2**-GRID_BITS.
GRID_BITS = 52
#: Width of the low limb.
LIMB_BITS = 40
#: Every contribution must satisfy |x| < 2**MAX_EXPONENT.
MAX_EXPONENT = 36
#: hi < 2**(MAX_EXPONENT + GRID_BITS - LIMB_BITS) = 2**48 per contribution: 2**15 of them fit in int64.
MAX_CONTRIBUTIONS = 2 ** (63 - (MAX_EXPONENT + GRID_BITS - LIMB_BITS))
#: Elements converted at a time (bounds the int64 temporaries of one fold to ~0.5 GiB).
CHUNK_ELEMENTS = 1 << 23


class GradientOutOfRange(FailedPrecondition):
    """A gradient element is outside the exact accumulator's range (the step cannot be summed exactly)."""


def _split(x: torch.Tensor, nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (lo, hi) limbs of fp32 values with |x| < 2**MAX_EXPONENT (non-finite ones, if any, give 0).

    Every float64 operation here is exact: an fp32 value is exact in float64; scaling by a power
    of two is exact; ``hi`` is an integer below 2**48; ``x - hi * 2**(LIMB_BITS - GRID_BITS)`` is
    the part of ``x`` below that grid, at most 24 significant bits.
    """
    x64 = x.to(torch.float64)
    if nonfinite:
        x64 = torch.nan_to_num(x64, nan=0.0, posinf=0.0, neginf=0.0)
    hi = torch.trunc(x64 * 2.0 ** (GRID_BITS - LIMB_BITS))
    low_part = x64.sub_(hi, alpha=2.0 ** (LIMB_BITS - GRID_BITS))
    lo = torch.trunc(low_part.mul_(2.0**GRID_BITS))
    return lo.to(torch.int64), hi.to(torch.int64)


def limbs_to_float(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The fp32 value of limbs (a deterministic function of the exact sum they hold)."""
    carry = torch.bitwise_right_shift(lo, LIMB_BITS)  # floor division: lo - (carry << LIMB_BITS) in [0, 2**LIMB_BITS)
    low = lo - torch.bitwise_left_shift(carry, LIMB_BITS)
    high = hi + carry
    value = high.to(torch.float64) * 2.0 ** (LIMB_BITS - GRID_BITS) + low.to(torch.float64) * 2.0**-GRID_BITS
    return value.to(torch.float32)


class ExactGradientSum:
    """Order-independent sums of fp32 gradient contributions, one per parameter tensor.

    Not thread-safe. ``add`` takes one contribution per parameter (``None`` = the parameter
    got no gradient from it); ``result`` is the fp32 sum per parameter (``None`` where no
    contribution ever touched it, as autograd leaves such a ``.grad`` unset).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        """Sums for gradients shaped like ``params`` (allocated on the first contribution)."""
        self._params = list(params)
        self._lo: list[torch.Tensor] = []
        self._hi: list[torch.Tensor] = []
        self._special: list[torch.Tensor | None] = []
        self._touched: list[bool] = []
        self.contributions = 0

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the sums are for, in order."""
        return self._params

    @property
    def allocated(self) -> bool:
        """Whether the limbs exist (after the first contribution since :meth:`free`)."""
        return bool(self._lo)

    def _allocate(self) -> None:
        if self._lo:
            return
        self._lo = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in self._params]
        self._hi = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in self._params]
        self._special = [None] * len(self._params)
        self._touched = [False] * len(self._params)

    def reset(self) -> None:
        """Zero sums, keeping the memory for the next step."""
        for lo, hi in zip(self._lo, self._hi, strict=True):
            lo.zero_()
            hi.zero_()
        self._special = [None] * len(self._params)
        self._touched = [False] * len(self._params)
        self.contributions = 0

    def free(self) -> None:
        """Zero sums and gives the limbs' memory back."""
        self._lo, self._hi, self._special, self._touched = [], [], [], []
        self.contributions = 0

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Adds one contribution (exactly).

        Raises:
            GradientOutOfRange: some element has ``|x| >= 2**MAX_EXPONENT``, or the step has more than
                ``MAX_CONTRIBUTIONS`` contributions; nothing of this contribution was added.
        """
        if len(grads) != len(self._params):
            raise FailedPrecondition(f"{len(grads)} gradients for {len(self._params)} parameters")
        if self.contributions + 1 > MAX_CONTRIBUTIONS:
            raise GradientOutOfRange(f"more than {MAX_CONTRIBUTIONS} gradient contributions in one step")
        present = [(i, g.detach().to(torch.float32)) for i, g in enumerate(grads) if g is not None]
        if not present:
            self.contributions += 1
            return
        # One device sync for the whole contribution, before any limb changes. amax propagates nan,
        # and nan < bound is False: the slow check below runs only when something is off.
        largest = torch.stack([g.abs().amax() for _, g in present])
        nonfinite = [False] * len(present)
        if not bool((largest < 2.0**MAX_EXPONENT).all()):
            checks = torch.stack([torch.stack([torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0).abs().amax()
                                               >= 2.0**MAX_EXPONENT, ~torch.isfinite(g).all()]) for _, g in present])
            flags = checks.tolist()
            if any(too_large for too_large, _ in flags):
                raise GradientOutOfRange(f"a gradient element has |x| >= 2**{MAX_EXPONENT}: the step cannot be "
                                         f"summed exactly")
            nonfinite = [bool(has_nonfinite) for _, has_nonfinite in flags]
        self._allocate()
        for (i, grad), has_nonfinite in zip(present, nonfinite, strict=True):
            flat = grad.reshape(-1)
            lo_sum, hi_sum = self._lo[i].view(-1), self._hi[i].view(-1)
            for start in range(0, flat.numel(), CHUNK_ELEMENTS):
                lo, hi = _split(flat[start:start + CHUNK_ELEMENTS], has_nonfinite)
                lo_sum[start:start + lo.numel()] += lo
                hi_sum[start:start + hi.numel()] += hi
            self._touched[i] = True
            if has_nonfinite:
                special = torch.where(torch.isfinite(grad), 0.0, grad)
                previous = self._special[i]
                self._special[i] = special if previous is None else previous + special
        self.contributions += 1

    def all_reduce(self, group: object) -> None:
        """Sums the limbs of every rank of ``group`` (exact: integer sums); every rank must call it."""
        import deepspeed.comm as dist

        self._allocate()
        for lo, hi in zip(self._lo, self._hi, strict=True):
            dist.all_reduce(lo, group=group)
            dist.all_reduce(hi, group=group)
        device = self._lo[0].device if self._lo else torch.device("cpu")
        counts = torch.tensor([self.contributions] + [int(t) for t in self._touched]
                              + [int(s is not None) for s in self._special], dtype=torch.int64, device=device)
        dist.all_reduce(counts, group=group)
        n = len(self._params)
        self.contributions = int(counts[0].item())
        self._touched = [bool(v) for v in counts[1:n + 1].tolist()]
        has_special = [bool(v) for v in counts[n + 1:].tolist()]
        for i, param in enumerate(self._params):
            if has_special[i]:
                special = self._special[i]
                if special is None:
                    special = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                dist.all_reduce(special, group=group)
                self._special[i] = special
        if self.contributions > MAX_CONTRIBUTIONS:
            raise GradientOutOfRange(f"{self.contributions} gradient contributions in one step over the ranks "
                                     f"(at most {MAX_CONTRIBUTIONS})")

    def result(self) -> list[torch.Tensor | None]:
        """The fp32 sum per parameter (in the parameter's dtype), ``None`` for untouched parameters."""
        if not self._lo:
            return [None] * len(self._params)
        out: list[torch.Tensor | None] = []
        for i, param in enumerate(self._params):
            if not self._touched[i]:
                out.append(None)
                continue
            value = limbs_to_float(self._lo[i], self._hi[i])
            special = self._special[i]
            if special is not None:
                value = torch.where(special != 0.0, special, value)  # nan != 0 holds: nan wins too
            out.append(value.to(param.dtype))
        return out

    @property
    def bytes_allocated(self) -> int:
        """Bytes the limbs (and non-finite sums) hold now."""
        total = sum(t.numel() * t.element_size() for t in self._lo + self._hi)
        return total + sum(s.numel() * s.element_size() for s in self._special if s is not None)
