"""When a run is hung, and how it is said: the rules both hang watches share, pure functions.

A function task's ranks (expgpu.train.watchdog) and a script task's (expgpu.script.watch) each watch their
own signs of progress (a step of run.steps; a row of expgpu.log, or output); the rules are one:

- the limit: `launch.hang.timeout_s`, or by default (auto) STEP_FACTOR x the slowest rank's recent step time,
  at least FLOOR_S; a rank in a slow phase (its first step, a checkpoint save, a `run.phase` block, its own
  code outside run.steps, the wait for a script's second row) has at least `launch.hang.slow_phase_s`
  (`limit`); ranks that have not begun a loop (SETUP) are not judged until one has (`judge`);
- a rank whose task function ended (returned, or sys.exit(0)) or whose last loop is over (its data ran out,
  its max_steps done) while another went on into a step it will never make: the other waits in that step's
  collective; at fault is the rank that was done first, said after ENDED_FLOOR_S (or STEP_FACTOR x the step
  time, or `launch.hang.timeout_s`) rather than the floor of a hang (`judge`);
- the rank(s) at fault: those behind the others' step, else, all at one step, those not waiting in a
  collective by their frames (`culprits`);
- the one line a hang prints: the rank(s) at fault, their own frame, where the others wait (`line`).
"""

from __future__ import annotations

from dataclasses import dataclass

# auto: the limit is never below this; with the tick, the stacks and the verdict's writing (~2 s) a hang of a
# fast loop is reported within a minute, while a minute-long stall of a healthy one (a file system's, a
# data loader's workers starting again) stays under it
FLOOR_S = 50.0
STEP_FACTOR = 20       # auto: this many of the slowest rank's recent step time
DONE = "done"       # a rank whose loop is over: no hang of its own while it waits for its peers
ENDED = "ended"     # a rank whose task function ended, now in expgpu's end of the run (last rows, checkpoint)
ENDED_IN_STEP = "ended in a step"   # ... from inside a step's body (a break, return or sys.exit(0) in run.steps)
# A rank whose last loop is over (still watched: its end-of-training save, its own code after the loop, a slow
# phase), and why; once its task has ended too, "ended: <why>". No rank may go on past it.
DATA_OUT = "data ran out"       # its loader (or iterable) ended before max_steps, or its last epoch's did
MAX_DONE = "max_steps done"
# a rank that went on into a step after a peer's task ended is waiting for it: said this soon (no slow phase
# of the peer's to wait out, and no healthy run looks like it)
ENDED_FLOOR_S = 10.0
FAILED = "failed"   # a rank whose task raised: its peers stop now (its own process may be slow to end)
# A rank whose run.steps / run.epochs has not begun: it builds, loads, downloads (its peers may wait for it in
# run.barrier(), under the collective's own timeout), or its task uses no run.steps at all. Nothing says how
# long that takes: such ranks hold no verdict alone, only beside a rank whose loop began (slow_phase_s then).
SETUP = "setup"


@dataclass(frozen=True)
class HangSettings:
    timeout_s: float | None   # None: auto
    slow_phase_s: float


def settings(cfg: dict) -> HangSettings | None:
    """launch.hang as settings; None when the watchdog is off (timeout_s: null)."""
    hang = cfg["launch"].get("hang") or {}
    timeout = hang.get("timeout_s", "auto")
    if timeout is None:
        return None
    return HangSettings(None if timeout == "auto" else float(timeout), float(hang.get("slow_phase_s", 600.0)))


def ended(phase: str) -> bool:
    """Whether a rank's task has ended (it waits for its peers in expgpu's end of the run): no hang of its own."""
    return phase in (DONE, ENDED, ENDED_IN_STEP) or phase.startswith(f"{ENDED}: ")


def past_steps(phase: str) -> bool:
    """Whether a rank's steps are over for good: its task ended, or its last loop did."""
    return ended(phase) or phase in (DATA_OUT, MAX_DONE)


def limit(s: HangSettings, phase: str, step_s: float | None) -> float:
    """How long a rank in `phase` may go without finishing a step."""
    base = s.timeout_s if s.timeout_s is not None else max(FLOOR_S, STEP_FACTOR * (step_s or 0.0))
    return base if phase == "train" else max(base, s.slow_phase_s)


def judge(records: dict[int, dict], s: HangSettings) -> dict | None:
    """The verdict on everyone's records ({rank: {step, phase, age, step_s}}), or None: no hang.
    A rank that failed is a verdict at once: its peers would wait for it in their next collective."""
    failed = sorted(r for r, rec in records.items() if rec["phase"] == FAILED)
    if failed:
        return {"failed": failed}
    active = {r: rec for r, rec in records.items() if not ended(rec["phase"])}
    if all(rec["phase"] == SETUP for rec in active.values()):
        return None
    slowest = max((rec.get("step_s") or 0.0) for rec in active.values())
    went_on = _went_on(records, active, s, slowest)
    if went_on is not None:
        return went_on
    over = {r: rec["age"] > limit(s, rec["phase"], slowest) for r, rec in active.items()}
    if not all(over.values()):
        return None
    top = max(rec["step"] for rec in active.values())
    behind = sorted(r for r, rec in active.items() if rec["step"] < top) or sorted(active)
    oldest = max(active[r]["age"] for r in behind)
    return {"behind": behind, "step": min(active[r]["step"] for r in behind) + 1, "waited_s": round(oldest, 1),
            "limit_s": round(limit(s, active[behind[0]]["phase"], slowest), 1),
            "ranks": {str(r): {"step": rec["step"], "phase": rec["phase"]} for r, rec in sorted(active.items())}}


def _went_on(records: dict[int, dict], active: dict[int, dict], s: HangSettings, slowest: float) -> dict | None:
    """The verdict when ranks ended their task after E steps while others went on, inside a step the ended ones
    never make, and have not finished it for their limit: the classic `if run.is_main: break` (or return) of an
    early stop decided on one rank; None otherwise. A rank that left from inside a step's body (which counts
    as done) may have left before its collectives: the others then wait in that step, E - 1 steps done. A rank
    behind that is the usual rule's."""
    done = {r: rec for r, rec in records.items() if past_steps(rec["phase"])}
    if not done or not active:
        return None
    end = min(rec["step"] for rec in done.values())
    first = sorted(r for r, rec in done.items() if rec["step"] == end)
    why = next((p for p in (ENDED_IN_STEP, DATA_OUT, MAX_DONE)
                for r in first if done[r]["phase"].removeprefix(f"{ENDED}: ") == p), ENDED)
    broke = why == ENDED_IN_STEP
    wait = s.timeout_s if s.timeout_s is not None else max(ENDED_FLOOR_S, STEP_FACTOR * slowest)
    on = {r: rec for r, rec in active.items()
          if rec["phase"] == "train" and rec["step"] >= end - broke and rec["age"] > wait}
    if not on:
        return None
    return {"ended": first, "went_on": sorted(on), "behind": first, "step": end, "why": why,
            "at": min(rec["step"] for rec in on.values()) + 1,
            "waited_s": round(max(rec["age"] for rec in on.values()), 1), "limit_s": round(wait, 1),
            "ranks": {str(r): {"step": rec["step"], "phase": rec["phase"]} for r, rec in sorted(records.items())}}


def held_up(records: dict[int, dict], me: int, timeout_s: float, error: str) -> str | None:
    """What a rank whose collective timed out (expgpu.errors.timed_out) after `timeout_s` waited for, by everyone's
    records ({rank: {step, phase, age}}), with `error` (its exception, one line): the ranks behind its step, else
    those at its step outside one (their own code, a run.phase, a save); None when no rank was."""
    mine = records.get(me)
    if mine is None:
        return None
    step = mine["step"]
    peers = {r: rec for r, rec in records.items() if r != me and rec["phase"] != FAILED}
    if mine["phase"] == SETUP:   # a collective of the setup (run.wrap's, a barrier): those still in theirs
        behind = {r: rec for r, rec in peers.items() if rec["phase"] == SETUP}
    else:   # a peer still in its setup is behind the first step too (its step is the run's start)
        behind = {r: rec for r, rec in peers.items() if rec["step"] < step or rec["phase"] == SETUP}
        behind = behind or {r: rec for r, rec in peers.items() if rec["step"] == step and rec["phase"] != "train"}
    if not behind:
        return None
    where = "; ".join(f"rank {r} {_held_by(rec)}" for r, rec in sorted(behind.items()))
    who = " and ".join(f"rank {r}" for r in sorted(behind))
    which = "before run.steps (in its setup)" if mine["phase"] == SETUP else f"in step {step + 1}"
    return (f"its collective {which} timed out after backend.timeout_s={timeout_s:g} s waiting for {who}: "
            f"{where} ({error}): work one rank does alone (an evaluation, a save or a download on rank 0 only) must "
            f"end within backend.timeout_s while the others wait: raise it above that work's length, or "
            + ("do it before the launch (a download, a dataset's preparation: a step of its own)"
               if all(rec["phase"] == SETUP for rec in behind.values()) else
               "share the work out over every rank (run.loader(..., drop_last=False) and run.all_reduce)"))


def _held_by(rec: dict) -> str:
    """Where a rank that others waited for was, by its record."""
    phase, step, age = rec["phase"], rec["step"], rec.get("age") or 0.0
    if phase == SETUP:
        return f"was still in its setup (its own code before run.steps), for {age:.0f} s"
    if past_steps(phase):
        return f"was done with its steps after step {step} ({phase})"
    if phase in ("train", "first step"):
        return f"was still in step {step + 1}, for {age:.0f} s"
    place = "its own code outside run.steps" if phase == "outside the steps" else f"its {phase}"
    return f"was in {place} after step {step}, for {age:.0f} s"


# Where a rank waits for its peers, by the innermost Python function it is in: a rank found there is
# waiting, not the one at fault (a DDP backward waits in the C++ engine, for the gradients' all-reduce).
WAITING = ("_engine_run_backward", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
           "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce_scatter",
           "reduce_scatter_tensor", "gather_object", "scatter_object_list", "wait", "synchronize", "all_to_all")


def waiting(frame: dict | None) -> bool:
    return bool(frame and frame.get("inside") and frame["inside"].split("'s ")[-1].split(".")[-1] in WAITING)


def culprits(verdict: dict, frames: dict[int, dict]) -> list[int]:
    """The rank(s) at fault: those behind the others' step, else, all at one step, those not waiting
    in a collective (by their frames); all of them when that tells nothing."""
    behind = verdict["behind"]
    if "ended" in verdict or len(behind) < len(verdict["ranks"]):
        return behind
    stuck = [r for r in behind if not waiting(frames.get(r))]
    return stuck if 0 < len(stuck) < len(behind) else behind


def line(verdict: dict, frames: dict[int, dict], head: str | None = None) -> str:
    """The one line a hang prints: the rank(s) at fault, the step, their own frame, where the others wait.
    `head`: what is late, said otherwise than a function task's step (a script's rows, its output)."""
    ranks = sorted(int(r) for r in verdict["ranks"])
    behind = culprits(verdict, frames)
    who = ", ".join(f"rank {r}" for r in behind)
    if "ended" in verdict:
        return _ended_line(verdict, frames, who)
    if head is None:
        head = (f"{who} {'has' if len(behind) == 1 else 'have'} not finished step {verdict['step']}"
                if len(behind) < len(ranks) or len(ranks) == 1 else f"no rank has finished step {verdict['step']}")
    parts = [f"{head} for {verdict['waited_s']:.0f} s (limit {verdict['limit_s']:.0f} s)"]
    parts += [f"rank {r} at {_frame(frames.get(r))}" for r in behind]
    others = [r for r in ranks if r not in behind]
    if others:
        where = {_frame(frames.get(r), short=True) for r in others}
        parts.append(f"the others ({', '.join(f'rank {r}' for r in others)}) wait {' / '.join(sorted(where))}")
    return "; ".join(parts)


def _ended_line(verdict: dict, frames: dict[int, dict], who: str) -> str:
    on = verdict["went_on"]
    others = ", ".join(f"rank {r}" for r in on)
    where = " / ".join(sorted({_frame(frames.get(r), short=True) for r in on}))
    one, step = len(verdict["ended"]) == 1, verdict["step"]
    how, fix = _ENDS.get(verdict["why"], _ENDS[ENDED])
    how = how.format(task="its task" if one else "their tasks", step=step, data="its" if one else "their")
    return (f"{who} {how} while {others} went on, and {'has' if len(on) == 1 else 'have'} waited "
            f"{verdict['waited_s']:.0f} s (limit {verdict['limit_s']:.0f} s) in step {verdict['at']}, {where}: {fix}")


# How the ranks that were first to be done with their steps were done, and what to do about it
_SAME_STEPS = "every rank must run the same number of steps"
_EARLY_STOP = ("every rank must leave run.steps at the same step (decide an early stop on every rank, e.g. on a "
               "run.all_reduce'd value, not on one rank alone)")
_ENDS = {
    ENDED_IN_STEP: ("ended {task} in step {step} (a break, return or sys.exit(0) in run.steps)", _EARLY_STOP),
    ENDED: ("ended {task} after step {step} (returned, or sys.exit(0))", _EARLY_STOP),
    DATA_OUT: ("ran out of data after step {step} ({data} loader ended)", f"{_SAME_STEPS}: give each the same "
               "number of batches (run.loader shares a dataset out equally; an iterable of your own must yield as "
               "many on every rank)"),
    MAX_DONE: ("did {data} max_steps ({step})", f"{_SAME_STEPS} (the same max_steps on every rank)"),
}


def _frame(frame: dict | None, short: bool = False) -> str:
    """A rank's place in words. A frame may say why it is unknown ({"unknown": "an unknown place (why)"})."""
    if frame is None:
        return "an unknown place (its watchdog could not run: a C call holding the GIL? see RUN_DIR/hang/)"
    if frame.get("unknown"):
        return "at an unknown place" if short else frame["unknown"]
    own, inside = frame.get("own"), frame.get("inside")
    if short:
        return f"in {inside}" + (f" at {own}" if own else "") if inside else f"at {own}" if own else "in expgpu's code"
    return f"{own or 'no frame of your code'}" + (f" (in {inside})" if inside else "")


__all__ = ["DATA_OUT", "DONE", "ENDED", "ENDED_FLOOR_S", "ENDED_IN_STEP", "FAILED", "FLOOR_S", "MAX_DONE", "SETUP",
           "STEP_FACTOR", "WAITING", "HangSettings", "culprits", "ended", "judge", "limit", "line", "past_steps",
           "settings", "waiting"]
