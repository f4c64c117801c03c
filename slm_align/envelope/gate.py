"""What the headroom gate hands the stages it guards (RL, preference) and the pipeline: its
verdict's figures, its report, and the one line a FAIL refuses with. Below the stages, so that
no stage imports the gate's stage to read its verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from slm_align.errors import UserError


class GateRefused(UserError):
    """The headroom gate said FAIL and --force was not given."""

    exit_code = 1


def sentence(text: str) -> str:
    """``text`` as a sentence: a capital first letter and a full stop (added when it has none)."""
    text = text.strip()
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def refusal(gate: str, report: dict) -> str:
    """The one line a FAIL gate refuses with: the reasons, each remedy as a sentence, and --force."""
    remedies = " ".join(sentence(remedy) for remedy in report["remedies"])
    return (f"{gate} FAIL ({'; '.join(report['reasons'])}): {remedies} "
            "Pass --force to train anyway (recorded in the manifest).")


@dataclass
class Figure:
    """One gated measurement: ``value`` must be below (``"<"``) or at least
    (``">="``) ``threshold``."""

    name: str
    value: float
    threshold: float
    comparison: str
    remedy: str

    @property
    def passed(self) -> bool:
        return self.value < self.threshold if self.comparison == "<" else self.value >= self.threshold


@dataclass
class HeadroomReport:
    """Every figure of the gate, context that is not gated (``info``), and the verdict."""

    figures: list[Figure]
    info: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.figures)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def failures(self) -> list[Figure]:
        return [f for f in self.figures if not f.passed]

    def summary(self) -> str:
        """The verdict and every figure against its threshold, on one line (the
        gate's end line in a log)."""
        figures = "; ".join(f"{f.name} {f.value:.3f} "
                            f"({f.comparison} {f.threshold:g})" for f in self.figures)
        return f"{self.verdict}, {figures}"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "passed": self.passed, "info": self.info,
                "figures": [dict(asdict(f), passed=f.passed) for f in self.figures],
                "reasons": [f"{f.name} {f.value:.4g} is not "
                            f"{f.comparison} {f.threshold:g}" for f in self.failures()],
                "remedies": [f.remedy for f in self.failures()]}
