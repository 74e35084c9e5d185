"""DraftPolicy: whether a request's next round should verify drafts, from its own acceptance.

A speculative round of K drafts costs more than a plain decode round (the verification rows,
the drafter's K passes, the commit): RoundCosts.ratio(K, context), a measured table whose level
a CUDA engine times on itself at start-up (round_costs.py). It yields the accepted drafts plus
one token, (1 - a^(K+1)) / (1 - a) tokens on average when each draft is accepted with
probability a. So
a request drafts while that yield beats the cost ratio, by a margin; otherwise it decodes plainly
(the drafter still extends its context over the plain rows, so drafting can resume at any
round), and probes again after a number of plain rounds that doubles after each failed probe.

The acceptance estimate is a decayed count of accepted over verified drafts, starting from a
prior, so the first rounds draft and a change of regime (thinking text to code) is followed
within a few rounds. A step is speculative when any of its requests drafts (the others verify
their drafts too: the round costs the same), so the decision is per request, the step's shape
per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.speculative.round_costs import RoundCosts

DECAY = 0.8  # weight of the previous rounds' counts at each verified round
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.5, 2.0  # a = 0.75 before any round, worth two drafts
MARGIN = 1.05  # draft only when the expected yield beats the cost by 5 %
FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL = 16, 256  # plain rounds before drafting is tried again


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a round commits on average: accepted drafts (a prefix) plus the target's one."""
    if acceptance >= 1.0:
        return num_drafts + 1.0
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


@dataclass
class DraftPolicy:
    num_drafts: int  # K, the drafts a round verifies
    accepted: float = PRIOR_ACCEPTED  # decayed counts
    drafted: float = PRIOR_DRAFTED
    plain_rounds: int = 0  # since drafting was switched off or last probed
    probe_interval: int = FIRST_PROBE_INTERVAL
    drafting: bool = True
    costs: RoundCosts = field(default_factory=RoundCosts)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted

    def worth_drafting(self, context: int) -> bool:
        return expected_tokens(self.acceptance, self.num_drafts) > MARGIN * self.costs.ratio(self.num_drafts, context)

    def wants_drafts(self, rounds_ahead: int = 0) -> bool:
        """Whether the next round (or the one after rounds_ahead more plain rounds) should verify
        this request's drafts, probes included."""
        return self.drafting or self.plain_rounds + rounds_ahead >= self.probe_interval

    def observe(self, num_drafted: int, num_accepted: int, context: int) -> None:
        """A verified round: num_accepted of num_drafted drafts kept (a round without drafts
        after plain rounds only refills them, and teaches nothing)."""
        if not num_drafted:
            return
        self.accepted = DECAY * self.accepted + num_accepted
        self.drafted = DECAY * self.drafted + num_drafted
        worth = self.worth_drafting(context)
        if self.drafting and not worth:
            self.drafting, self.plain_rounds = False, 0
        elif not self.drafting:
            # A probe: drafting again when it pays, else wait twice as long for the next one.
            self.plain_rounds = 0
            if worth:
                self.drafting, self.probe_interval = True, FIRST_PROBE_INTERVAL
            else:
                self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)

    def plain_round(self) -> None:
        self.plain_rounds += 1
