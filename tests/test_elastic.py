"""Workers that come and go (issue 16): the session bookkeeping against hand-computed values, then an outer
service and its workers as separate processes on loopback (tests/scripts/elastic_run.py)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from benchmarks import elastic
from benchmarks.elastic import free_port, read_json
from lightning_hdet.asynchronous.elastic.membership import parse_address
from lightning_hdet.asynchronous.elastic.sessions import (
    SessionTable,
    backoff,
    session_seed,
    should_park,
)
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.messages import Kind, Push


# pure bookkeeping
def test_leases_are_renewed_by_a_changed_counter_and_expire_after_lease_s() -> None:
    table = SessionTable(lease_s=10.0)
    table.open(1, now=0.0)
    table.open(2, now=3.0)
    table.beat(1, beats=1, now=5.0)  # renewed at 5
    table.beat(2, beats=4, now=6.0)  # renewed at 6
    table.beat(1, beats=1, now=9.0)  # unchanged: not renewed
    assert table.expired(now=14.9) == []
    assert table.expired(now=15.0) == [1]  # 15 - 5 >= 10
    assert table.expired(now=16.0) == [1, 2]
    assert table.end(1, "expired") and not table.end(1, "expired")  # once
    assert sorted(table.live) == [2] and table.ended == {1: "expired"}
    assert table.next_id == 3


def test_session_ids_are_never_reused_and_a_restart_continues_after_the_checkpoint() -> None:
    table = SessionTable(lease_s=1.0, next_id=7)
    table.open(7, now=0.0)
    table.end(7, "left")
    with pytest.raises(ValueError, match="never reused"):
        table.open(7, now=1.0)
    table.open(9, now=1.0)
    assert table.next_id == 10 and not table.is_live(7) and table.is_live(9)
    with pytest.raises(ValueError, match="lease_s"):
        SessionTable(lease_s=0)


def test_a_worker_is_parked_only_while_others_hold_budget_in_flight() -> None:
    assert should_park(0, budget_left=10, others_in_flight=10)
    assert not should_park(0, budget_left=10, others_in_flight=0)  # nobody can release anything: stop
    assert not should_park(0, budget_left=0, others_in_flight=5)  # budget spent: stop
    assert not should_park(3, budget_left=10, others_in_flight=5)  # it got a round
    assert not should_park(0, budget_left=None, others_in_flight=5)  # no budget: a stop was requested


def test_backoff_doubles_up_to_its_cap_and_seeds_differ_per_session() -> None:
    assert [backoff(k) for k in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert [session_seed(100, s) for s in (1, 2, 9)] == [101, 102, 109]


def test_release_returns_in_flight_steps_and_drops_speed_and_buffers() -> None:
    outer = OuterSettings(local_steps=4, outer="published").build(torch.zeros(3), torch.zeros(1), 2, budget=20)
    hello = [Push(w, Kind.HELLO, 0, 0.0, 0.0) for w in (1, 2)]
    assert outer.process(hello) == {1: 4, 2: 4}
    push = Push(1, Kind.PUSH, 4, 1.0, 0.0, pseudo_gradient=torch.zeros(3), buffers=torch.tensor([2.0]))
    assert outer.process([push]) == {1: 4}  # 20 - 4 done - 4 in flight at worker 2 leaves 12
    outer.worker_buffers[2] = torch.tensor([4.0])
    outer.release(2)
    assert outer.workers[2].in_flight == 0 and 2 not in outer.worker_buffers
    assert outer.buffers.tolist() == [2.0]  # the mean of the workers that remain
    assert 1 in outer.local_steps.speeds and 2 not in outer.local_steps.speeds


class _LoopbackGroup:
    """Both ends of a two-rank group in one process: what one sends on a tag, the other receives in order."""

    class _Done:
        def wait(self) -> None:
            pass

    def __init__(self) -> None:
        self.queues: dict[int, list[torch.Tensor]] = {}

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Done:
        self.queues.setdefault(tag, []).append(tensors[0].clone())
        return self._Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Done:
        tensors[0].copy_(self.queues[tag].pop(0))
        return self._Done()


@pytest.mark.parametrize("pull", ["none", "bf16"])
def test_session_transports_stream_fragments_and_the_service_gets_a_whole_push(pull: str) -> None:
    from lightning_hdet.asynchronous.elastic.transport import SessionServerEnd, SessionWorkerTransport
    from lightning_hdet.asynchronous.wire.messages import Fragments, ServerHeader, WorkerHeader

    layout = Fragments([torch.Size([6, 4]), torch.Size([5])], "bf16", max_bytes=4 * 8,  # several fragments
                       pull_compression=pull)  # type: ignore[arg-type]
    assert len(layout.fragments) > 2
    group = _LoopbackGroup()
    worker, server = SessionWorkerTransport(group, 7, layout), SessionServerEnd(group, 7, 2, layout)
    gradient = torch.arange(29, dtype=torch.float32) / 4  # exact in bf16
    worker.push(WorkerHeader(Kind.PUSH, 3, 1.5, 0.25, 0), layout.encode(gradient), torch.tensor([1.0, 2.0]), None)
    push = server.receive()
    assert (push.worker, push.kind, push.steps) == (7, Kind.PUSH, 3) and push.buffers.tolist() == [1.0, 2.0]
    torch.testing.assert_close(push.pseudo_gradient, gradient)
    assert push.payload_bytes == layout.nbytes + 8
    params, into = torch.randn(29), torch.zeros(31)
    server.reply(ServerHeader(4, 9), params, torch.tensor([3.0, 4.0]))
    assert worker.pull(into) == ServerHeader(4, 9)
    pulled = params if pull == "none" else params.bfloat16().float()  # what a bf16 pull leaves the worker with
    torch.testing.assert_close(into, torch.cat([pulled, torch.tensor([3.0, 4.0])]), rtol=0, atol=0)
    assert not any(group.queues.values())  # nothing left over on either tag


def test_parse_address_names_the_argument() -> None:
    assert parse_address("127.0.0.1:29400") == ("127.0.0.1", 29400)
    assert parse_address("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError, match="`server`"):
        parse_address("localhost")


def test_arguments_are_checked_before_anything_connects() -> None:
    from lightning_hdet import ElasticWorkerStrategy, OuterService
    from tests.helpers import LinearModel

    with pytest.raises(ValueError, match="`server`"):
        ElasticWorkerStrategy("no-port")
    with pytest.raises(ValueError, match="`reconnect_s`"):
        ElasticWorkerStrategy("127.0.0.1:1", reconnect_s=-1)
    with pytest.raises(ValueError, match="`momentum_activation`"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10,
                     outer=DelayedNesterov(lr=0.5, momentum_activation=0.1, buffer_size=2))
    with pytest.raises(ValueError, match="`budget`"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=0)
    service = OuterService(LinearModel(), "127.0.0.1:0", budget=10, local_steps=3)  # binds nothing before run()
    assert service.hub is None and service.outer.budget == 10


# processes on loopback (started by benchmarks.elastic.launch), each forked from an interpreter that imported torch
# and Lightning once (benchmarks/forked.py): a run of 4 to 6 processes spared their ~4 s of imports each
launch = functools.partial(elastic.launch, fork=True)


def test_a_forked_process_runs_its_script_as_its_own_interpreter_would(tmp_path: Path) -> None:
    """benchmarks/forked.py, which starts the processes below: the script's directory first on ``sys.path``, its
    arguments, environment and working directory, its output in the log (stderr apart if asked); its exit status
    (``sys.exit``, an exception's 1 with the traceback, a signal's ``-signum``) after its ``atexit`` handlers ran, as
    with ``subprocess.Popen``; one still running when this process exits is killed (multiprocessing would wait for
    it)."""
    from benchmarks import forked

    (tmp_path / "sibling.py").write_text("WORD = 'sibling'\n")
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, os, sys, time\nimport sibling\n"
        "atexit.register(lambda: open(sys.argv[1] + '.atexit', 'w').close())\n"
        "print(sibling.WORD, __name__, os.environ['FORKED_TEST'], os.getcwd(), *sys.argv[1:], flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "if sys.argv[2] == 'raise': raise KeyError('boom')\n"
        "if sys.argv[2] == 'sleep': time.sleep(600)\n"
        "sys.exit(int(sys.argv[2]))\n")
    procs = {how: forked.start(str(script), [str(tmp_path / how), how], {"FORKED_TEST": "env"}, str(tmp_path / how),
                               cwd=str(tmp_path), err=str(tmp_path / "3.err") if how == "3" else None)
             for how in ("3", "raise", "sleep")}
    assert procs["3"].wait(timeout=60) == 3 and procs["raise"].wait(timeout=60) == 1 and procs["sleep"].poll() is None
    forked._kill_left_over()  # at this process's exit: what still runs is killed, not waited for
    assert procs["sleep"].wait(timeout=60) == -signal.SIGKILL
    assert (tmp_path / "3").read_text() == f"sibling __main__ env {tmp_path} {tmp_path / '3'} 3\n"
    assert (tmp_path / "3.err").read_text() == "to stderr\n"  # apart where asked, as Popen's stderr
    assert "to stderr\n" in (tmp_path / "raise").read_text() and "KeyError: 'boom'" in (tmp_path / "raise").read_text()
    assert (tmp_path / "3.atexit").exists() and (tmp_path / "raise.atexit").exists()
    assert not (tmp_path / "sleep.atexit").exists() and procs["sleep"].poll() == -signal.SIGKILL


def _wait_for(condition, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _finish(procs: list[subprocess.Popen], timeout: float = 300.0) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="module")
def killed_and_joined(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Service + 4 workers; worker 4 SIGKILLs itself mid-round after 3 exchanges and worker 3 is preempted (SIGTERM,
    which Lightning turns into an exception) after 4; a fifth worker starts once the
    run is under way. The others wait at their step 20 until the fifth has joined (80 of 240 steps), so both
    happen mid-run whatever the machine's load (no timing is asserted). Worker 2's loss is NaN from its step 22 on
    (just after that wait: mid-run, with most of the budget left)."""
    d = tmp_path_factory.mktemp("elastic")
    address = f"127.0.0.1:{free_port()}"
    joined = d / "joined"
    common = ["--address", address, "--step-s", "0.05", "--hold-at", "20", "--hold-until", str(joined)]
    server = launch("server", d / "server.json", "--address", address, "--budget", "240", "--checkpoint",
                    str(d / "ckpt.pt"))
    dies = {2: ["--nan-from", "22"], 3: ["--die-after", "4", "--die-by", "term"], 4: ["--die-after", "3"]}
    workers = [launch("worker", d / f"w{i}.json", *common, *dies.get(i, [])) for i in range(1, 5)]
    status = d / "ckpt.pt.status.json"
    _wait_for(lambda: read_json(status).get("outer_updates", 0) >= 4, "the run to be under way")
    fifth = launch("worker", d / "w5.json", *common, "--mark-joined", str(joined))
    codes = _finish([*workers, fifth, server])
    return {"dir": d, "codes": codes, "server": json.loads((d / "server.json").read_text())}


@pytest.mark.timeout(600)
def test_killed_and_preempted_workers_end_only_their_sessions_and_the_others_finish_the_budget(killed_and_joined: dict) -> None:
    codes, server = killed_and_joined["codes"], killed_and_joined["server"]
    assert codes[3] == -signal.SIGKILL  # the killed worker
    # The preempted one stopped on its SIGTERM before finishing (Lightning then exits with status 0).
    d = killed_and_joined["dir"]
    assert "Received SIGTERM" in (d / "w3.log").read_text() and not (d / "w3.json").exists()
    assert codes[:3] == [0, 0, 0] and codes[4] == 0 and codes[5] == 0  # everyone else, the service included
    assert server["steps_done"] == server["budget"] == 240  # their unfinished rounds were discarded, redone
    lost = [s for s, why in server["ended"].items() if why.startswith("lost")]
    assert len(lost) == 2 and server["live"] == []
    assert server["finite"] and server["final_loss"] < server["initial_loss"]


@pytest.mark.timeout(600)
def test_a_worker_gone_nan_is_rejected_and_ends_its_session_while_the_others_finish(killed_and_joined: dict) -> None:
    """Issue 29 in the elastic mode: worker 2 discards its non-finite rounds itself (each counted as a rejection by
    the service, in its log and its status) and after 3 in a row is told to stop: only its session ends, the
    others' pushes were all applied, and the global model is finite and better than at the start."""
    d, server = killed_and_joined["dir"], killed_and_joined["server"]
    (bad,) = json.loads((d / "w2.json").read_text())["sessions"]
    assert killed_and_joined["codes"][1] == 0 and server["ended"][str(bad)] == "excluded: 3 pushes in a row rejected"
    assert server["workers"][str(bad)]["rejected"] == 3
    assert [s for s, why in server["ended"].items() if why.startswith("excluded")] == [str(bad)]
    assert all(stats["rejected"] == 0 for s, stats in server["workers"].items() if s != str(bad))
    assert (d / "server.log").read_text().count(f"A push of worker {bad} was rejected") == 3
    assert "stops: its last 3 push(es) in a row were rejected" in (d / "w2.log").read_text()
    assert server["finite"] and server["final_loss"] < server["initial_loss"]


@pytest.mark.timeout(600)
def test_a_fifth_worker_joins_mid_run_and_pushes(killed_and_joined: dict) -> None:
    server = killed_and_joined["server"]
    fifth = json.loads((killed_and_joined["dir"] / "w5.json").read_text())
    (session,) = fifth["sessions"]
    stats = server["workers"][str(session)]
    assert stats["steps"] > 0 and stats["rounds"] > 0 and fifth["inner_steps"] >= stats["steps"]
    assert fifth["rounds"][0][1] > 0  # it started from a global model that had already been updated
    assert server["ended"][str(session)] == "left"


@pytest.mark.timeout(600)
def test_a_killed_service_restarts_from_its_checkpoint_and_workers_reconnect(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    ckpt, status = tmp_path / "ckpt.pt", tmp_path / "ckpt.pt.status.json"
    serve = ["--address", address, "--budget", "160", "--checkpoint", str(ckpt)]
    server = launch("server", tmp_path / "server1.json", *serve)
    pace = ["--address", address, "--step-s", "0.2"]
    patient = [launch("worker", tmp_path / f"w{i}.json", *pace, "--reconnect-s", "180") for i in (1, 2)]
    impatient = launch("worker", tmp_path / "w3.json", *pace, "--reconnect-s", "0")
    _wait_for(lambda: read_json(status).get("outer_updates", 0) >= 4, "the run to be under way")
    server.kill()
    server.wait()
    at_kill = read_json(status)
    assert _finish([impatient]) == [1]  # reconnect_s=0: fails as soon as its session is lost
    assert "No outer service reachable" in (tmp_path / "w3.log").read_text()
    restarted = launch("server", tmp_path / "server2.json", *serve)
    assert _finish([*patient, restarted]) == [0, 0, 0]
    result = json.loads((tmp_path / "server2.json").read_text())
    assert result["outer_updates"] > at_kill["outer_updates"] and result["steps_done"] == 160
    for i in (1, 2):
        sessions = json.loads((tmp_path / f"w{i}.json").read_text())["sessions"]
        assert len(sessions) == 2 and min(sessions[1:]) > max(int(s) for s in at_kill["workers"])
    assert result["finite"] and result["final_loss"] < result["initial_loss"]


@pytest.mark.timeout(600)
def test_a_frozen_worker_expires_and_its_share_of_the_budget_goes_to_the_live_set(tmp_path: Path) -> None:
    """One worker frozen by SIGSTOP: its heartbeats stop, its lease expires, its steps in flight are released and
    the other worker's steps finish the budget without it."""
    address = f"127.0.0.1:{free_port()}"
    status = tmp_path / "ckpt.pt.status.json"
    server = launch("server", tmp_path / "server.json", "--address", address, "--budget", "192", "--lease-s", "4",
                    "--checkpoint", str(tmp_path / "ckpt.pt"))
    go = tmp_path / "go"
    workers = [launch("worker", tmp_path / f"w{i}.json", "--address", address, "--step-s", "0.05", "--go", str(go))
               for i in (1, 2)]
    try:
        # Both workers in, then freeze one. They start training together: on a loaded machine the second's start-up
        # (imports) could otherwise outlast the first's whole budget.
        _wait_for(lambda: all((tmp_path / f"w{i}.ready").exists() for i in (1, 2)), "both workers to start")
        go.touch()
        both = lambda: len(read_json(status).get("live", [])) >= 2  # noqa: E731
        _wait_for(lambda: read_json(status).get("outer_updates", 0) >= 2 and both(), "the run under way with both")
        workers[1].send_signal(signal.SIGSTOP)
        assert _finish([workers[0], server]) == [0, 0]
    finally:
        workers[1].kill()
    result = json.loads((tmp_path / "server.json").read_text())
    assert sorted(result["ended"].values()) == ["expired", "left"]
    assert result["steps_done"] == 192 and result["finite"] and result["final_loss"] < result["initial_loss"]


def test_workers_frozen_while_joining_and_while_pulling_expire_and_the_other_finishes(tmp_path: Path) -> None:
    """Two workers that SIGSTOP themselves, one as it is about to meet the service (registered, its heartbeat
    started), one as it is about to pull its first reply: the service's loop never waits on either (it meets and
    answers each worker on that session's own threads), so both leases expire and the third worker finishes the
    budget. Before, the service's side of the meeting waited on the store connection the heartbeat reads
    share, and a reply waited for the frozen worker to receive it: no lease could expire until ``timeout_s`` (30
    minutes by default) had passed. (One service run for both freezes: each worker start costs seconds.)"""
    address = f"127.0.0.1:{free_port()}"
    server = launch("server", tmp_path / "server.json", "--address", address, "--budget", "48", "--lease-s", "3")
    frozen = [launch("worker", tmp_path / f"frozen_{at}.json", "--address", address, "--freeze-at", at)
              for at in ("join", "pull")]
    try:
        worker = launch("worker", tmp_path / "w.json", "--address", address, "--step-s", "0.02")
        assert _finish([worker, server]) == [0, 0]
    finally:
        for f in frozen:
            f.kill()
    result = json.loads((tmp_path / "server.json").read_text())
    assert sorted(result["ended"].values()) == ["expired", "expired", "left"]
    assert result["steps_done"] == 48 and result["finite"] and result["final_loss"] < result["initial_loss"]
    # the service's end-of-run summary says what each session did and why it ended
    lines = result["summary"].splitlines()
    assert lines[0].startswith("Async Local-SGD result: 48 inner steps of a budget of 48 over ")
    assert sum(line.endswith("; expired") for line in lines) == 2 and any(line.endswith("; left") for line in lines)


@pytest.mark.timeout(600)
def test_the_service_validates_the_global_model_and_stops_every_worker_early(tmp_path: Path) -> None:
    """Validation and early stopping in one place: the service evaluates the global model every 2 outer updates and
    requests a stop once its loss is below 1.0, long before a budget of 100000 steps."""
    address = f"127.0.0.1:{free_port()}"
    server = launch("server", tmp_path / "server.json", "--address", address, "--budget", "100000",
                    "--stop-below", "1.0")
    # Each worker holds at its first step until the other has started, so both are in the run before it stops.
    started = {i: tmp_path / f"started{i}" for i in (1, 2)}
    workers = [launch("worker", tmp_path / f"w{i}.json", "--address", address, "--mark-joined", str(started[i]),
                      "--hold-at", "1", "--hold-until", str(started[3 - i])) for i in (1, 2)]
    assert _finish([*workers, server]) == [0, 0, 0]
    result = json.loads((tmp_path / "server.json").read_text())
    # The service's own record: (outer updates, metrics) every 2 updates until the stop, then once at the end.
    losses = [(updates, metrics["val_loss"]) for updates, metrics in result["evaluations"]]
    stop = next(i for i, (_, loss) in enumerate(losses) if loss < 1.0)
    assert losses[0][1] > 1.0 and all(u == 2 * (i + 1) for i, (u, _) in enumerate(losses[: stop + 1]))
    # Rounds already handed out finish after the stop request: at most one more per worker.
    assert losses[-1][0] <= losses[stop][0] + 2 and losses[-1][1] == pytest.approx(result["final_loss"])
    assert result["steps_done"] < 100000 and result["final_loss"] < 1.0 and result["live"] == []
    for i in (1, 2):  # both workers trained, then left on the stop reply
        assert json.loads((tmp_path / f"w{i}.json").read_text())["inner_steps"] > 0
    assert sorted(result["ended"].values()) == ["left", "left"]


def test_the_service_gives_up_waiting_for_a_worker_whose_session_ended_before_it_met_the_service() -> None:
    """One process: a session registered whose worker never meets the service (frozen between registering and
    meeting). Its receiving thread waits in short checks, not inside gloo's rendezvous, so once the session is dropped
    (its lease ran out) the thread ends with nothing put in the inbox: no thread is left behind on a frozen worker."""
    import threading

    from lightning_hdet.asynchronous.elastic.hub import SessionHub
    from lightning_hdet.asynchronous.wire.messages import Fragments

    hub = SessionHub("127.0.0.1:0", {}, next_id=1, timeout=600.0, n_buffers=0, layout=Fragments([(2,)], "none"))
    hub.attach(1)
    receiving = next(t for t in threading.enumerate() if t.name == "elastic-session-1")
    hub.drop(1)
    hub.close()
    receiving.join(timeout=30)  # a hang detector: it ends within a few MEET_POLL_S, not after the 600 s timeout
    assert not receiving.is_alive() and hub.inbox.empty()


def test_closing_the_service_does_not_wait_for_a_reply_stuck_on_a_frozen_worker() -> None:
    """One process: a session's reply blocks for good (its worker froze mid-exchange; gloo's abort does not end a
    pending send). Once the session is dropped (its lease ran out), ``close`` waits for the group's teardown but not
    for that thread: with an unbounded ``timeout`` this test would hang (the suite's timeout fails it); before,
    ``run()`` ended ``timeout`` (30 s) late after such a worker."""
    import queue
    import threading

    from lightning_hdet.asynchronous.elastic.hub import SessionHub
    from lightning_hdet.asynchronous.wire.messages import Fragments, ServerHeader

    sending, frozen, torn_down = threading.Event(), threading.Event(), threading.Event()

    class FrozenPeer:
        class group:  # noqa: N801  (stands for the session's gloo group)
            abort = staticmethod(torn_down.set)

        def reply(self, *message: object) -> None:
            sending.set()
            frozen.wait()  # a send to a SIGSTOPped worker

    hub = SessionHub("127.0.0.1:0", {}, next_id=1, timeout=600.0, n_buffers=0, layout=Fragments([(2,)], "none"))
    end, outbox = FrozenPeer(), queue.Queue()
    hub._ends[1], hub._outboxes[1] = end, outbox  # as _receive leaves them once the worker met the service
    hub._start(hub._send_replies, 1, end, outbox, name="elastic-reply-1")
    hub.reply(1, ServerHeader(4, 1), torch.zeros(2), torch.zeros(0))
    assert sending.wait(30)
    hub.drop(1, unresponsive=True)  # the lease ran out
    hub.close(timeout=None)  # returns: the teardown is joined, the stuck reply is not
    assert torn_down.is_set()
    replying = next(t for t in threading.enumerate() if t.name == "elastic-reply-1")
    assert replying.is_alive()  # still blocked: a daemon, it ends with the process
    frozen.set()
    replying.join(timeout=30)


def test_a_token_keeps_out_workers_without_it_and_admits_those_with_it() -> None:
    """One process: the service's store on loopback, its admissions on a thread; workers register from this
    thread (the session's gloo group is left out). A worker without the token is refused before it takes a session
    id; one with a wrong token takes an id that is refused (and never reused); one with the right token is
    admitted."""
    import threading
    from unittest import mock

    from lightning_hdet import OuterService
    from lightning_hdet.asynchronous.elastic.membership import Registration
    from tests.helpers import LinearModel

    with pytest.raises(ValueError, match="`token` must be None or a non-empty string, got '<hidden>'"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10, token="")
    service = OuterService(LinearModel(), "127.0.0.1:0", budget=10, token="s3cret")
    service.start()
    address, admitted, stop = f"127.0.0.1:{service.hub.port}", [], threading.Event()

    def admissions() -> None:
        while not stop.is_set():
            admitted.extend(service._admitted(time.monotonic()))
            stop.wait(0.02)

    thread = threading.Thread(target=admissions, daemon=True)
    thread.start()
    try:
        with mock.patch("lightning_hdet.asynchronous.elastic.membership.session_group"):
            with pytest.raises(PermissionError, match="requires a `token`"):
                Registration(address, 1.0, 30.0, 5.0)
            with pytest.raises(PermissionError, match="refused this worker: its `token` does not match"):
                Registration(address, 1.0, 30.0, 5.0, token="guess")
            registration = Registration(address, 1.0, 30.0, 5.0, token="s3cret")
            registration.close()
        # the worker learns it is admitted inside `_admitted`, before the thread records the id: let it finish
        stop.set()
        thread.join(5)
        assert registration.session == 2 and admitted == [2] and service.table.ended == {1: "refused: wrong token"}
    finally:
        stop.set()
        thread.join(5)
        service.hub.close()


def test_a_session_rejected_max_rejections_times_in_a_row_is_told_to_stop_and_ends() -> None:
    """The service's own loop, one process, with a hub that records replies: session 1 pushes NaN three times;
    each is rejected (the global model stays the start), the third reply says stop with 3 rejections, and the
    session ends as excluded (its group torn down after that reply is sent)."""
    from lightning_hdet import OuterService
    from lightning_hdet.asynchronous.wire.messages import Push
    from tests.helpers import LinearModel

    class Hub:
        def __init__(self) -> None:
            self.replies: list = []
            self.dropped: list = []

        def reply(self, session, header, params, buffers) -> None:
            self.replies.append(header)

        def drop(self, session, flush=False, unresponsive=False) -> None:
            self.dropped.append((session, flush))

    service = OuterService(LinearModel(), "127.0.0.1:0", budget=100, local_steps=2)
    service.hub = Hub()
    start = service.outer.params.clone()
    service.table.open(1, time.monotonic())
    service._apply([Push(1, Kind.HELLO, 0, 0.0, 0.0)])
    for _ in range(3):
        service._apply([Push(1, Kind.PUSH, 2, 1.0, 0.0, torch.full((9,), float("nan")))])
    assert [(h.next_local_steps, h.rejected) for h in service.hub.replies] == [(2, 0), (2, 1), (2, 2), (0, 3)]
    assert service.table.ended == {1: "excluded: 3 pushes in a row rejected"} and not service.table.live
    assert service.hub.dropped == [(1, True)]  # its group goes only once the stop reply was sent
    assert torch.equal(service.outer.params, start) and service.outer.steps_done == 0
    assert service.status()["workers"]["1"]["rejected"] == 3
    # every reply with steps sent the model (9 float32 parameters, no buffers): the pulls are counted too
    assert service.result.workers[1].pull_bytes == 3 * 9 * 4


@pytest.mark.timeout(300)
def test_a_worker_job_of_two_ranks_is_one_session_whose_ranks_stay_identical(tmp_path: Path) -> None:
    """Issue 42: a service, a worker job of 2 ranks (DDP inside: ElasticDDPWorkerStrategy, devices=2) and a
    one-device worker. The job is ONE session (its rank 0 meets the service and hands every reply on); a round of H
    steps counts H against the budget; both of its ranks end with the same parameters and the same last pulled
    global model."""
    address = f"127.0.0.1:{free_port()}"
    server = launch("server", tmp_path / "server.json", "--address", address, "--budget", "64", "--local-steps", "4")
    pace = ["--address", address, "--step-s", "0.01"]
    joined = tmp_path / "joined"  # the one-device worker waits at its step 4 until the job (slower to start) joined
    job = launch("worker", tmp_path / "job.json", *pace, "--devices", "2", "--mark-joined", str(joined))
    one = launch("worker", tmp_path / "one.json", *pace, "--hold-at", "4", "--hold-until", str(joined))
    codes = _finish([job, one, server], timeout=240)
    assert codes == [0, 0, 0]
    rank1 = tmp_path / "job.rank1.json"  # rank 1 is the job's child process: it may finish just after rank 0
    _wait_for(lambda: bool(read_json(rank1)), "the job's rank 1 to write its result", timeout=60)
    server, r0, r1, single = (json.loads((tmp_path / f"{name}.json").read_text())
                              for name in ("server", "job", "job.rank1", "one"))
    assert server["steps_done"] == server["budget"] == 64 and server["live"] == []
    assert sorted(server["ended"].values()) == ["left", "left"] and len(server["workers"]) == 2  # 2 sessions
    (session,) = r0["sessions"]
    assert r1["sessions"] == [session] and single["sessions"] != [session]
    assert r0["rounds"] == r1["rounds"] and r0["inner_steps"] == r1["inner_steps"] > 0
    assert r0["params"] == r1["params"] and r0["pulled"] == r1["pulled"]  # bit for bit
    job_steps = server["workers"][str(session)]["steps"]
    assert job_steps == r0["inner_steps"]  # H per round of H steps (each step reads one batch per rank)
    assert job_steps + server["workers"][str(single["sessions"][0])]["steps"] == 64
    assert server["finite"] and server["final_loss"] < server["initial_loss"]


def test_an_elastic_service_refuses_delta_pulls_before_it_starts() -> None:
    from lightning_hdet import OuterService
    from tests.helpers import LinearModel

    with pytest.raises(ValueError, match=r"`pull_compression` must be NoCodec\(\) or BF16\(\) \('none', 'bf16'\) with an"
                                         r" elastic service, got Int8\(chunk=256\). A change of the public model needs"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10, pull_compression="int8")


def test_an_elastic_service_refuses_diloco_naming_torchft_before_it_starts() -> None:
    # DiLoCo across jobs moved to TorchFTStrategy (issue 61): the old use fails with the fix in its message; what
    # only DiLoCo had (SparseLoCo, staggered parts) is refused by the async settings in turn.
    from lightning_hdet import OuterService
    from tests.helpers import LinearModel

    with pytest.raises(ValueError, match=r"`mode` must be 'async' with an elastic service, got 'sync'. DiLoCo across "
                                         r"jobs runs on torchft: each job TorchFTStrategy\(TorchFT\(lighthouse="):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10, mode="sync", local_steps=4)
    with pytest.raises(ValueError, match=r"`mode` must be 'sync' \(DiLoCo\) with SparseLoCo, got 'async'"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10, outer="sparseloco", compression="topk2")
    with pytest.raises(ValueError, match=r"`stagger=2` applies to DiLoCo only"):
        OuterService(LinearModel(), "127.0.0.1:0", budget=10, local_steps=4, stagger=2)
    service = OuterService(LinearModel(), "127.0.0.1:0", budget=10, local_steps=4, outer="stable")
    assert service.settings.mode == "async" and not service.settings.outer.forwards_rounds
