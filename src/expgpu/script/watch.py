"""A script task's hang watch: each rank's supervisor watches its script, and the ranks agree on a hang.

What a rank's supervisor sees of its script, once a second (PERIOD_S):
- its heartbeat (expgpu.script.heartbeat): the step that expgpu.log logged last, on every rank whose script
  calls it (rank 0's rows are metrics.jsonl; another rank's calls only beat);
- its output: when it last wrote to stdout or stderr (RUN_DIR/logs/rank<N>.script.log grew).

The rules are the function tasks' (expgpu.procs.hang_rules), on these signs:
- steps (launch.hang.timeout_s, unless null): a rank whose logged step has not moved for its limit is past
  it; auto: 20 x the slowest rank's recent time per logged step, at least launch.hang.slow_phase_s (600 s),
  as expgpu cannot see a script's evaluations and saves (a function task's run.phase) that log nothing for
  a while; seconds: that limit, and until a rank's second row (the first may come before compiling) at
  least launch.hang.slow_phase_s. Before its first row, nothing
  says that a script logs at all: a rank is watched by steps from its start (with slow_phase_s) only once a
  rank of the world has logged a row, which is how a rank that never logs (rows are rank 0's) stops holding
  a verdict in a script that does;
- output (task.output_timeout_s, unless null): a rank whose script wrote nothing for that long is past it.
A rank that shows a watched sign in time is not past its limit. It is a hang when every rank whose script still
runs is past its limit, at least one by a watched sign: a rank with nothing watched neither holds a verdict
nor makes one (ranks in lockstep all stop when one does; a rank that logs while its peer evaluates holds it).

The ranks share no store (the script makes its own process group), only the run dir: each publishes its record
(RUN_DIR/.expgpu/script-watch-rank<N>.json) when it changed, at most once a second, so a stalled rank writes
nothing; a rank past its own limit reads everyone's; the first to find a hang claims it
(RUN_DIR/.expgpu/script-hang-<launch>.json, made at once, whole, once). Every rank that sees the claim (within a
second) writes its script's stacks to RUN_DIR/hang/rank<N>.txt (py-spy's dump of the script and its
subprocesses where py-spy is on PATH; else, as nothing else reads a process's stack without its help, its last
output lines) and its frame for the line, and stops its script (grace_s, then SIGKILL). The claimer names the
rank(s) at fault in one line, writes result.json (status hung) and, last, RUN_DIR/hang/verdict.json, which
the others wait for; every rank's process then exits with EXIT_HUNG (124), and the supervisor says
`expgpu: hung: <line>` (restarts follow, launch.on_hang).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from expgpu import rundir
from expgpu.procs import stacks
from expgpu.procs.hang_rules import DONE, HangSettings, culprits, limit, line, settings
from expgpu.rundir import atomic_write_bytes
from expgpu.script.heartbeat import Heartbeat
from expgpu.script.result import read_json

log = logging.getLogger("expgpu")

PERIOD_S = 1.0          # how often a rank reads its script's signs, publishes them, looks for a claim
SPY_TIMEOUT_S = 20.0    # py-spy's time to read a script's stack
FRAMES_WAIT_S = 10.0    # the claimer waits this long for every rank's frame
VERDICT_WAIT_S = 90.0   # a rank that did not claim waits this long for the verdict before it exits
TAIL_LINES = 30         # the script's last output lines in RUN_DIR/hang/rank<N>.txt
START, FIRST, TRAIN = "start", "first", "train"   # before its first row; until its second; after


class Watch:
    """One rank's watch of its script, ticked by expgpu.script.process (`tick`); after a hang, the claimer's
    `conclude` and the others' `wait_for_verdict`."""

    def __init__(self, s: HangSettings | None, output_s: float | None, rank: int, world: int, run_dir: Path,
                 launch: str, log_path: Path):
        self.s, self.output_s, self.rank, self.world = s, output_s, rank, world
        self.run_dir, self.launch, self.log_path = Path(run_dir), launch, Path(log_path)
        self.heartbeat = Heartbeat()
        self.started = time.time()
        self.step, self.moves = -1, 0     # as the heartbeat says: the step logged last, how many times it moved
        self.moved = self.started        # when the logged step last moved (or the script started)
        self.step_s: float | None = None  # the recent time per logged step
        self.output = self.started       # when the script last wrote output
        self.output_at: float | None = None
        self.next_tick = 0.0
        self.published: dict | None = None
        self.claimed = False
        self.verdict: dict | None = None

    @classmethod
    def of(cls, cfg: dict, output_s: float | None, rank: int, world: int, run_dir: Path, launch: str,
           log_path: Path) -> Watch | None:
        """This rank's watch; None when neither sign is watched (launch.hang.timeout_s and
        task.output_timeout_s both null)."""
        s = settings(cfg)
        if s is None and output_s is None:
            return None
        return cls(s, output_s, rank, world, run_dir, launch, log_path)

    def env(self) -> dict[str, str]:
        """What the script's environment needs for expgpu.log to beat."""
        return self.heartbeat.env()

    def tick(self, pid: int, output_at: float) -> bool:
        """Once a second: read the script's signs, publish them, judge; True when the run hung (this
        rank's stacks are written: stop its script)."""
        mono = time.monotonic()
        if mono < self.next_tick:
            return False
        self.next_tick = mono + PERIOD_S
        now = time.time()
        if output_at != self.output_at:
            self.output, self.output_at = now - (mono - output_at), output_at
        moves, step = self.heartbeat.read()
        if moves != self.moves:
            if self.moves:   # per logged step: several logged since the last look count as one (the limit grows)
                took = now - self.moved
                self.step_s = took if self.step_s is None else max(took, 0.9 * self.step_s)
            self.moves, self.step, self.moved = moves, step, now
        mine = self.record()
        self._publish(mine)
        claim = self._claim_of_this_launch()
        if claim is None and past(mine, self.s, self.output_s, now, logging=mine["phase"] != START):
            verdict = judge(self._records(mine), self.s, self.output_s, now)
            if verdict is not None:
                claim = self._claim(verdict)
        if claim is None:
            return False
        self._stacks(claim, pid)
        return True

    def record(self, phase: str | None = None) -> dict:
        rec = {"launch": self.launch, "rank": self.rank, "phase": phase or (START if not self.moves else
                                                                           FIRST if self.moves == 1 else TRAIN),
               "logged": self.moves > 0, "step": self.step, "moved": round(self.moved, 3), "step_s": self.step_s}
        if self.output_s is not None:
            rec["output"] = round(self.output, 3)
        return rec

    def _publish(self, rec: dict) -> None:
        if rec != self.published:
            atomic_write_bytes(rundir.script_watch(self.run_dir, self.rank), json.dumps(rec).encode())
            self.published = rec

    def _records(self, mine: dict) -> dict[int, dict]:
        """Every rank's record of this launch; {} until every rank has published one."""
        out = {self.rank: mine}
        for r in range(self.world):
            if r != self.rank:
                rec = read_json(rundir.script_watch(self.run_dir, r))
                if rec is None or rec.get("launch") != self.launch:
                    return {}
                out[r] = rec
        return out

    def _claim_of_this_launch(self) -> dict | None:
        return read_json(rundir.script_hang_claim(self.run_dir, self.launch))

    def _claim(self, verdict: dict) -> dict:
        """Claim the hang, once for the launch (a link made whole or not at all); the claim that won."""
        path = rundir.script_hang_claim(self.run_dir, self.launch)
        verdict = {**verdict, "launch": self.launch, "by": self.rank}
        tmp = path.with_name(f".{path.name}.{self.rank}")
        tmp.write_text(json.dumps(verdict))
        try:
            os.link(tmp, path)
            self.claimed = True
            return verdict
        except FileExistsError:
            return read_json(path) or verdict
        finally:
            tmp.unlink(missing_ok=True)

    def _stacks(self, claim: dict, pid: int) -> None:
        """This rank's part of a hang: its frame (for the line) and its script's stacks, while it runs."""
        self.verdict = claim
        tail = last_output(self.log_path)
        frame = stacks.spied_frame(pid, SPY_TIMEOUT_S) or {"own": None, "unknown": _unknown(tail)}
        atomic_write_bytes(rundir.script_frame(self.run_dir, self.rank),
                           json.dumps({"launch": self.launch, "frame": frame}).encode())
        dump = stacks.spy(pid, SPY_TIMEOUT_S, subprocesses=True)
        rec = self.record()
        lines = [f"rank {self.rank}'s script (pid {pid}, {socket.gethostname()}), step last logged "
                 f"{rec['step'] if rec['phase'] != START else 'none'}, {rec['phase']}; the run hung: "
                 f"{json.dumps(claim)}", ""]
        if dump is not None:
            lines += ["--- py-spy dump --native --subprocesses ---", dump.rstrip("\n"), ""]
        else:
            lines += ["(py-spy is not on PATH, so the script's stack cannot be read from outside it: pip install "
                      "py-spy, or 'expgpu[hang]', for every thread's stack here next time)", ""]
        lines += [f"--- its last {TAIL_LINES} lines of output ({self.log_path}) ---", *tail]
        path = rundir.hang_stack(self.run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        if not self.claimed:
            log.warning("rank %d: the run hung (rank %s saw it): stopping the script; its stacks: %s", self.rank,
                        claim.get("by"), path)

    def done(self) -> None:
        """The script ended (not hung): this rank holds no verdict from now on."""
        self._publish(self.record(DONE))

    def close(self) -> None:
        self.heartbeat.close()

    def conclude(self) -> dict:
        """The claimer's verdict, whole: everyone's frames, the rank(s) at fault and the line."""
        verdict = dict(self.verdict)
        ranks = [int(r) for r in verdict["ranks"]]
        frames = self._frames(ranks)
        verdict["culprits"] = culprits(verdict, frames)
        verdict["line"] = line(verdict, frames, head=head(verdict, verdict["culprits"]))
        verdict["frames"] = {str(r): f for r, f in frames.items()}
        return verdict

    def _frames(self, ranks: list[int]) -> dict[int, dict]:
        deadline = time.monotonic() + FRAMES_WAIT_S
        frames: dict[int, dict] = {}
        while True:
            for r in ranks:
                doc = read_json(rundir.script_frame(self.run_dir, r)) if r not in frames else None
                if doc is not None and doc.get("launch") == self.launch:
                    frames[r] = doc["frame"]
            if len(frames) == len(ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        missing = "an unknown place (its rank's supervisor did not say where its script was: see RUN_DIR/hang/)"
        return {r: frames.get(r) or {"own": None, "unknown": missing} for r in ranks}

    def write_verdict(self, verdict: dict) -> None:
        """RUN_DIR/hang/verdict.json, which the supervisor reads (its line) and the other ranks wait for."""
        rundir.hang_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(rundir.hang_verdict(self.run_dir), (json.dumps(verdict, indent=2) + "\n").encode())

    def wait_for_verdict(self) -> None:
        deadline = time.monotonic() + VERDICT_WAIT_S
        while time.monotonic() < deadline:
            doc = read_json(rundir.hang_verdict(self.run_dir))
            if doc is not None and doc.get("launch") == self.launch:
                return
            time.sleep(0.2)


def signs(rec: dict, s: HangSettings | None, output_s: float | None, now: float, logging: bool,
          step_s: float | None = None) -> list[tuple[str, float, float]]:
    """The watched signs of a rank's record: (which, seconds since it last showed, its limit). `logging`: a rank
    of the world has logged a row (a rank yet to log its first is then watched by steps too)."""
    out = []
    if s is not None and (rec["phase"] != START or logging):
        # under auto every stretch may be a slow one (the module's docstring); seconds given are the user's
        phase = TRAIN if rec["phase"] == TRAIN and s.timeout_s is not None else FIRST
        out.append(("steps", now - rec["moved"], limit(s, phase, step_s if step_s is not None else rec["step_s"])))
    if output_s is not None and "output" in rec:
        out.append(("output", now - rec["output"], output_s))
    return out


def past(rec: dict, s: HangSettings | None, output_s: float | None, now: float, logging: bool,
         step_s: float | None = None) -> bool:
    """A rank is past its limit when it has a watched sign and every one is late."""
    watched = signs(rec, s, output_s, now, logging, step_s)
    return bool(watched) and all(age > lim for _, age, lim in watched)


def judge(records: dict[int, dict], s: HangSettings | None, output_s: float | None, now: float) -> dict | None:
    """The verdict on every rank's record ({rank: record}: its phase, step, when it moved, its step time, its
    last output), or None: no hang. Shaped as expgpu.procs.hang_rules' (behind, ranks, waited_s, limit_s)."""
    active = {r: rec for r, rec in records.items() if rec["phase"] != DONE}
    if not active:
        return None
    logging = any(rec.get("logged") for rec in records.values())
    slowest = max((rec.get("step_s") or 0.0) for rec in active.values())
    watched = {r: signs(rec, s, output_s, now, logging, slowest) for r, rec in active.items()}
    if not any(watched.values()) or not all(age > lim for w in watched.values() for _, age, lim in w):
        return None
    logged = {r: rec["step"] for r, rec in active.items() if rec.get("logged")}
    top = max(logged.values(), default=None)
    behind = sorted(r for r, step in logged.items() if step < top) or sorted(active)
    # what the line says is late: the steps where the rank(s) behind are watched by them, else the output
    late = [w for r in behind for w in watched[r]] or [w for ws in watched.values() for w in ws]
    sign = "steps" if any(which == "steps" for which, _, _ in late) else "output"
    late = [(age, lim) for which, age, lim in late if which == sign]
    return {"behind": behind, "sign": sign, "step": top, "waited_s": round(max(a for a, _ in late), 1),
            "limit_s": round(max(lim for _, lim in late), 1),
            "ranks": {str(r): {**({"step": rec["step"]} if rec.get("logged") else {}), "phase": rec["phase"]}
                      for r, rec in sorted(active.items())}}


def head(verdict: dict, named: list[int]) -> str:
    """What is late, said for the rank(s) at fault: `rank 1 has logged no step after step 4`, `no rank has
    logged a step after step 9`, `rank 0 has written no output`."""
    ranks = verdict["ranks"]
    who = ", ".join(f"rank {r}" for r in named)
    has = "has" if len(named) == 1 else "have"
    alone = len(named) < len(ranks) or len(ranks) == 1
    if verdict["sign"] == "output":
        return f"{who} {has} written no output" if alone else "no rank has written output"
    steps = [ranks[str(r)]["step"] for r in named if "step" in ranks[str(r)]]
    if alone:
        return f"{who} {has} logged no step" + (f" after step {min(steps)}" if steps else "")
    return "no rank has logged a step" + (f" after step {verdict['step']}" if verdict["step"] is not None else "")


def last_output(path: Path, lines: int = TAIL_LINES, tail_bytes: int = 65536) -> list[str]:
    """The script's last lines of output (both streams, as its log holds them)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _unknown(tail: list[str]) -> str:
    said = next((ln.strip() for ln in reversed(tail) if ln.strip() and not ln.startswith("--- expgpu: ")), None)
    last = f"its last output: {said[:120]!r}" if said else "it wrote no output"
    why = "py-spy could not read it" if stacks.has_spy() else "no py-spy on PATH to read it"
    return f"an unknown place ({why}; {last})"
