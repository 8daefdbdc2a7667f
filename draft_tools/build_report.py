"""The end of a draft build: the held-out check, and the summary that says how to serve it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kenspec.draft_tools.train import evaluate
from kenspec.server.engine.kenlm_draft import DRAFT_MANIFEST
from kenspec.server.settings import SpeculationSettings


@dataclass(frozen=True, slots=True)
class CheckResult:
    """Held-out replay of the draft at the server's default k and min_draft_prob (greedy)."""

    answers: int
    tokens: int
    k: int
    min_draft_prob: float
    tokens_per_round: float  # the n-gram alone
    acceptance: float  # accepted / drafted tokens, the n-gram alone
    context_tokens_per_round: float  # with context drafting (the server's default), chains

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckResult:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class StageTime:
    """How long one stage of a build took; `skipped`: it found its work done before."""

    stage: str
    seconds: float
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.stage} {_duration(self.seconds)}" + " (done before)" * self.skipped


def check_draft(
    model: Path, draft: Path, answers: Path, speculation: SpeculationSettings
) -> CheckResult:
    """Replay the held-out answers through the draft alone and with context drafting (as the
    server drafts by default: the request's own tokens and the suffix index seeded from the
    draft's corpus; chains, not trees, which no cost model would cut in a replay)."""
    served = {
        "k": speculation.request_defaults.k,
        "adaptive": speculation.adaptive,
        "min_draft_prob": speculation.min_draft_prob,
    }
    alone = evaluate(model, draft, answers, **served)
    context = evaluate(
        model,
        draft,
        answers,
        **served,
        context=True,
        min_match=speculation.context_min_match,
        suffix=speculation.suffix_index,
        long_draft_tokens=speculation.long_draft_tokens,
    )
    return CheckResult(
        answers=alone.answers,
        tokens=alone.tokens,
        k=speculation.request_defaults.k,
        min_draft_prob=speculation.min_draft_prob,
        tokens_per_round=round(alone.tokens_per_round, 4),
        acceptance=round(alone.acceptance, 4),
        context_tokens_per_round=round(context.tokens_per_round, 4),
    )


def summary(
    serve_flags: Sequence[str],
    draft: Path,
    check: CheckResult | None,
    times: Sequence[StageTime] = (),
) -> str:
    """Where the draft is, how big, how good on held-out answers, the time each stage took
    and the command to serve it (`serve_flags`: the server's --model and what goes with it)."""
    manifest = json.loads((draft / DRAFT_MANIFEST).read_text())
    files = sorted(p for p in draft.iterdir() if p.is_file())
    sizes = ", ".join(f"{p.name} {_size(p.stat().st_size)}" for p in files)
    lines = [
        f"draft: {draft} ({_size(sum(p.stat().st_size for p in files))}: {sizes})",
        f"  {manifest['order']}-gram over {manifest['corpus_tokens']:,} tokens "
        f"({manifest['corpus_lines']:,} lines); {manifest['corpus']}",
    ]
    if check is None:
        lines.append(
            "  no held-out check (give --prompts with --heldout > 0, or --heldout-prompts)"
        )
    else:
        lines += [
            f"  held-out check: {check.answers} answers, {check.tokens:,} tokens, greedy, "
            f"k={check.k}, min_draft_prob={check.min_draft_prob:g} (1.00 tokens/round: no gain)",
            f"    the n-gram alone: {check.tokens_per_round:.2f} tokens/round, "
            f"acceptance {check.acceptance:.2f}",
            f"    with context drafting (the server's default): "
            f"{check.context_tokens_per_round:.2f} tokens/round",
        ]
    if times:
        total = _duration(sum(t.seconds for t in times))
        lines.append(f"time by stage ({total} in all): " + ", ".join(map(str, times)))
    command = ["kenspec", "serve", *serve_flags, "--draft", str(draft)]
    lines += [
        "serve it:",
        "  " + shlex.join(command),
        f"({draft / 'work'} only serves to resume or re-check; the server does not read it)",
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    """
    >>> _duration(0.042), _duration(75.3), _duration(4000)
    ('0.04 s', '1 min 15 s', '66 min 40 s')
    """
    if seconds < 60:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def _size(count: int) -> str:
    """
    >>> _size(3_141_592)
    '3.1 MB'
    """
    if count < 1000:
        return f"{count} B"
    value, unit = count / 1000, "KB"
    for bigger in ("MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.1f} {unit}"
