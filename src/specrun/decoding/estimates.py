"""AutoPolicy's running estimates: per-position acceptance (``Acceptance``), how often
something happens (``Rate``), and what passes and draft steps cost (``Costs``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrun.decoding import costmodel
from specrun.decoding.priors import PRIORS, AutoPriors


class Acceptance:
    """Running estimate of cumulative per-position acceptance, from conditional rates.

    Position i of a draft is *tried* when positions 0..i-1 were accepted, and a *hit* when it
    is accepted too; its conditional rate is hits / tries. Positions after the first rejection
    say nothing about their own rate and are not counted. One acceptance process underlies all
    positions, so each position's rate is shrunk toward the rate of the *other* positions
    (a deep position, seldom reached, borrows from them; its own data is not counted twice),
    itself shrunk toward the prior. ``cum[i]`` is the product of the rates of positions 0..i
    (monotone by construction). Counts decay (an EMA in count form, ``alpha`` per draft, every
    position, reached or not) so that a change of text is tracked: deep positions that a run of
    early rejections no longer reaches must not keep vouching for the others. (Per-position
    EMAs of the cumulative rate learnt far slower: docs/auto.md, ``accept_alpha``.)
    """

    def __init__(
        self, prior: float, k: int, alpha: float | None = None, priors: AutoPriors | None = None
    ) -> None:
        pr = priors or PRIORS
        self.prior, self.k = prior, k
        self.alpha = pr.accept_alpha if alpha is None else alpha
        self.prior_n, self.shrink_n = pr.prior_n, pr.shrink_n
        self.hits = [0.0] * k
        self.tries = [0.0] * k
        # estimate()'s answer and the prior it was made with, until the counts move (auto asks
        # for the draft model's on every step, where it runs one step in a hundred)
        self._est: tuple[float, list[float]] | None = None

    def update(self, k: int, n_accepted: int) -> None:
        """A draft of ``k`` tokens whose first ``n_accepted`` were accepted."""
        self.age()
        for i in range(min(k, n_accepted + 1, self.k)):
            self.add(i, i < n_accepted)

    def age(self) -> None:
        """A new draft: every position ages, reached or not."""
        keep = 1.0 - self.alpha
        for i in range(self.k):
            self.hits[i] *= keep
            self.tries[i] *= keep
        self._est = None

    def add(self, i: int, hit: bool, weight: float = 1.0) -> None:
        """Position ``i`` of the last draft was tried (its positions before it accepted), worth
        ``weight`` observations."""
        if i < self.k:
            self.hits[i] += weight if hit else 0.0
            self.tries[i] += weight
            self._est = None

    def scale(self, w: float) -> None:
        """Keep this share of every count (what a new request keeps of the last one's)."""
        self.hits = [h * w for h in self.hits]
        self.tries = [t * w for t in self.tries]
        self._est = None

    def rates(self) -> list[float]:
        """Conditional acceptance per position."""
        h_all, n_all = sum(self.hits), sum(self.tries)
        out = []
        for h, n in zip(self.hits, self.tries, strict=True):
            others = (h_all - h + self.prior_n * self.prior) / (n_all - n + self.prior_n)
            out.append((h + self.shrink_n * others) / (n + self.shrink_n))
        return out

    def estimate(self) -> list[float]:
        """Cumulative acceptance per position (the list is shared: do not change it)."""
        if self._est is not None and self._est[0] == self.prior:
            return self._est[1]
        out, c = [], 1.0
        for r in self.rates():
            c *= r
            out.append(c)
        self._est = (self.prior, out)
        return out


@dataclass
class Rate:
    """Running estimate of how often something happens (the draft model stopping at a
    position): a plain average over the first observations, with the prior counted as
    ``prior_n`` of them, then an EMA."""

    p: float
    alpha: float = PRIORS.stop_alpha
    seen: int = 0
    prior_n: float = PRIORS.prior_n

    def update(self, hit: bool) -> None:
        w = max(self.alpha, 1.0 / (self.seen + 1 + self.prior_n))
        self.p += w * ((1.0 if hit else 0.0) - self.p)
        self.seen += 1


@dataclass
class Costs:
    """Online measurements: target pass seconds by rows, draft step seconds."""

    verify: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)  # passes measured this run, by rows
    draft_step: float | None = None
    draft_n: int = 0
    catch_up_row: float | None = None  # seconds per row of a draft catch-up of 2+ rows
    alpha: float = PRIORS.cost_alpha
    slope: float = PRIORS.verify_slope  # V(n)'s slope until two sizes are measured
    # verify_cost()'s answer, kept while V(n) stands: a one-row pass moves every size alike
    # (observe_verify), so only a pass of more rows, a size first seen, or seeding changes it.
    _v: costmodel.VerifyCost | None = field(default=None, init=False, repr=False)

    def seed(self, verify: dict[int, float]) -> None:
        """Measured pass seconds by rows (a calibration), as if observed."""
        self.verify.update(verify)
        self._v = None

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        if rows > 1:
            per = seconds / rows
            old = self.catch_up_row
            self.catch_up_row = per if old is None else old + self.alpha * (per - old)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.seen[rows] = self.seen.get(rows, 0) + 1
        old = self.verify.get(rows)
        new = seconds if old is None else old + self.alpha * (seconds - old)
        if rows == 1 and old is not None and old > 0.0:
            # The machine's pace moves a pass of every size alike (a busy neighbour, the clock, a
            # longer context): passes of more rows, seen seldom (some only at calibration), keep
            # their ratio to one row, V(n), rather than seconds from when one row took other
            # time (left as seconds, a drifting row made batches look cheaper than they are).
            scale = new / old
            for r in self.verify:
                if r != 1:
                    self.verify[r] *= scale
        else:
            self._v = None  # V(rows) moved, or one row was first seen
        self.verify[rows] = new

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        per = seconds / steps
        self.draft_n += 1
        # A plain average over the first observations, then an EMA: one slow early step must
        # not price the draft model out for the rest of the run.
        w = max(self.alpha, 1.0 / self.draft_n)
        self.draft_step = (
            per if self.draft_step is None else self.draft_step + w * (per - self.draft_step)
        )

    def t1(self) -> float | None:
        if 1 in self.verify:
            return self.verify[1]
        if self.verify:  # extrapolate from the smallest batch seen, with the prior slope
            r = min(self.verify)
            return self.verify[r] / (1.0 + self.slope * (r - 1))
        return None

    def verify_cost(self) -> costmodel.VerifyCost:
        """V(n) relative to one row: measured where seen, else a line through what was seen."""
        if self._v is None:
            self._v = self._verify_cost()
        return self._v

    def _verify_cost(self) -> costmodel.VerifyCost:
        t1 = self.t1()
        if t1 is None or t1 <= 0:
            return costmodel.linear_verify_cost(self.slope)
        rows = sorted(r for r in self.verify if r > 1)
        if rows:
            r = rows[-1]
            slope = max(0.0, (self.verify[r] / t1 - 1.0) / (r - 1))
        else:
            slope = self.slope
        seen = {r: t / t1 for r, t in self.verify.items()}
        pts = sorted(seen.items())

        def v(n: int) -> float:
            got = seen.get(n)
            if got is not None:
                return got
            # Between two sizes measured (a calibration measures 1, 2, 3, 5 and 9 rows): on
            # the line between them; beyond the largest, on the line from one row to it.
            lo = hi = None
            for r, x in pts:
                if r < n:
                    lo = (r, x)
                elif r > n:
                    hi = (r, x)
                    break
            if lo is not None and hi is not None:
                got = lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])
            else:
                got = 1.0 + slope * (n - 1)
            seen[n] = got  # asked again within the step: the cost model prices K = 1..k_max
            return got

        return v
