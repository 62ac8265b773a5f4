"""Log routing: node/rank prefixes, per-node files, events to the progress view, first errors."""

from __future__ import annotations

from vpscluster.launch.logs import LogRouter, split_rank
from vpscluster.train.events import format_event


def test_split_rank():
    assert split_rank("[rank3]:hello") == (3, "hello")
    assert split_rank("[rank0]: spaced") == (0, "spaced")
    assert split_rank("[rank1]:[rank1]: RuntimeError: x") == (1, "RuntimeError: x")
    assert split_rank("W1202 agent line") == (None, "W1202 agent line")


def test_router_prefixes_logs_and_routes_events(tmp_path):
    shown, events = [], []
    r = LogRouter(tmp_path / "logs", ["a", "b"], show=shown.append, on_event=events.append)
    r.for_node("a")("stdout", "[rank0]:" + format_event("step", step=1, loss=2.5))
    r.for_node("a")("stdout", "[rank0]:plain line")
    r.for_node("b")("stderr", "[rank1]:other rank")
    r.for_node("b")("stderr", "agent says hi")
    r.note("a", "$ cd x && exec ...")
    r.close()
    assert events == [{"event": "step", "step": 1, "loss": 2.5}]
    assert shown == ["a/0: plain line", "b/1: other rank", "b: agent says hi", "a/launcher: $ cd x && exec ..."]
    assert r.rank0_node == "a"
    a_log = (tmp_path / "logs" / "a.log").read_text()
    assert "a/0 stdout: plain line" in a_log and "VPSC_EVENT" in a_log  # the file keeps everything
    assert "b/1 stderr: other rank" in (tmp_path / "logs" / "b.log").read_text()


def test_first_error_prefers_the_worker_traceback(tmp_path):
    r = LogRouter(tmp_path, ["n"])
    feed = r.for_node("n")
    feed("stderr", "[W1202 19:48:59.887 socket.cpp:207] [c10d] The hostname cannot be retrieved")
    feed("stderr", "[rank2]:Traceback (most recent call last):")
    feed("stderr", '[rank2]:  File "t.py", line 3, in <module>')
    feed("stderr", "[rank2]:    boom()")
    feed("stderr", "[rank2]:ValueError: the real problem")
    feed("stderr", "[rank2]:")
    feed("stderr", "Traceback (most recent call last):")
    feed("stderr", '  File "run.py", line 1')
    feed("stderr", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    r.close()
    assert r.first_error("n") == "ValueError: the real problem"


def test_first_error_falls_back_to_last_stderr_line_not_a_warning(tmp_path):
    r = LogRouter(tmp_path, ["n"])
    feed = r.for_node("n")
    feed("stderr", "python: can't open file 'x.py': [Errno 2] No such file or directory")
    feed("stderr", "[W1202 19:48:59.887 socket.cpp:207] noise")
    feed("stderr", "UserWarning: also noise")
    r.close()
    assert r.first_error("n") == "python: can't open file 'x.py': [Errno 2] No such file or directory"
    r2 = LogRouter(tmp_path / "2", ["m"])
    r2.close()
    assert r2.first_error("m") is None


def test_culprit_is_the_node_with_its_own_error_not_a_lost_peer():
    from vpscluster.launch.pipeline import NodeOutcome, _culprit

    outcomes = {
        "a": NodeOutcome("a", 1, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.3]:1"),
        "b": NodeOutcome("b", 0, None),
        "c": NodeOutcome("c", 1, "ValueError: bad batch"),
    }
    assert _culprit("a", outcomes) == "c"
    outcomes["c"].first_error = "torch.distributed.DistBackendError: NCCL communicator was aborted"
    assert _culprit("a", outcomes) == "a"  # nobody has a better story: the first to fail


def test_a_rank_killed_by_a_signal_is_the_first_error(tmp_path):
    """Its peers' errors (a lost connection) follow from it: the agent's account comes first."""
    r = LogRouter(tmp_path, ["n"], file_names={"n": "launcher.log"})
    feed = r.for_node("n")
    feed("stderr", "[rank0]:Traceback (most recent call last):")
    feed("stderr", '[rank0]:  File "t.py", line 3, in <module>')
    feed("stderr", "[rank0]:RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242")
    feed("stderr", "E1203 09:17:30.1 torch/distributed/elastic/multiprocessing/api.py:882] failed "
                   "(exitcode: -9) local_rank: 1 (pid: 4242) of binary: /usr/bin/python3")
    r.close()
    assert r.first_error("n") == "local rank 1 was killed by SIGKILL"
    assert (tmp_path / "launcher.log").exists() and not (tmp_path / "n.log").exists()


def test_worker_death_wording(tmp_path):
    from vpscluster.launch.logs import worker_death

    assert worker_death("failed (exitcode: -15) local_rank: 0 (pid: 1)") == "local rank 0 was killed by SIGTERM"
    assert worker_death("failed (exitcode: 3) local_rank: 2 (pid: 1)") == "local rank 2 exited with status 3"
    assert worker_death("all good") is None
    # An exit status alone says less than the worker's own traceback: that one stays first.
    r = LogRouter(tmp_path, ["n"])
    r.for_node("n")("stderr", "[rank1]:Traceback (most recent call last):")
    r.for_node("n")("stderr", "[rank1]:ValueError: bad input")
    r.for_node("n")("stderr", "failed (exitcode: 1) local_rank: 1 (pid: 9)")
    r.close()
    assert r.first_error("n") == "ValueError: bad input"


def test_a_rank_that_aborts_after_its_own_error_is_named_by_that_error(tmp_path):
    """SIGABRT after an uncaught exception (gloo's destructor) is a consequence, not the cause."""
    r = LogRouter(tmp_path, ["n"])
    feed = r.for_node("n")
    feed("stderr", "[rank2]:Traceback (most recent call last):")
    feed("stderr", '[rank2]:  File "fail_on_rank.py", line 27, in <module>')
    feed("stderr", "[rank2]:RuntimeError: deliberate failure on rank 2 (pid 77)")
    feed("stderr", "E1203 09:17:30.1 api.py:882] failed (exitcode: -6) local_rank: 0 (pid: 77) of binary: python3")
    r.close()
    assert r.first_error("n") == "RuntimeError: deliberate failure on rank 2 (pid 77)"
    # With no traceback at all, the abort is still named.
    r2 = LogRouter(tmp_path / "b", ["n"])
    r2.for_node("n")("stderr", "failed (exitcode: -6) local_rank: 0 (pid: 78) of binary: python3")
    r2.close()
    assert r2.first_error("n") == "local rank 0 was killed by SIGABRT"


def test_a_stdout_line_landing_inside_a_stderr_traceback_is_not_the_error(tmp_path):
    # stdout and stderr reach the launcher through separate pipes: the rank's last print, made
    # before it raised, may arrive between the traceback's frames (seen in CI).
    r = LogRouter(tmp_path, ["n"])
    feed = r.for_node("n")
    feed("stderr", "[rank2]:Traceback (most recent call last):")
    feed("stderr", '[rank2]:  File "fail_on_rank.py", line 33, in <module>')
    feed("stdout", "[rank2]:rank 2 joined a group of 3, sum 3")
    feed("stderr", "[rank2]:    main()")
    feed("stderr", "[rank2]:RuntimeError: deliberate failure on rank 2 (pid 77)")
    assert r.first_error("n") == "RuntimeError: deliberate failure on rank 2 (pid 77)"


def test_a_cpp_stack_trace_is_one_line_on_screen_and_whole_in_the_log(tmp_path):
    shown: list[str] = []
    router = LogRouter(tmp_path, ["node-2"], show=shown.append)
    feed = router.for_node("node-2")
    feed("stderr", "[W1204 16:27:05.502 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3): Failed to recv")
    feed("stderr", "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):")
    for i in range(30):
        feed("stderr", f"frame #{i}: <unknown function> + 0x{i:x} (0x7ff in /venv/lib/libtorch_cpu.so)")
    feed("stderr", "W1204 16:27:05.105000 15199 dynamic_rendezvous.py:1298] The node has failed to shutdown the rendezvous")
    feed("stderr", "frame #0: again, a second trace")
    router.close()
    frames = [l for l in shown if "frame #" in l]
    pointers = [l for l in shown if "C++ stack trace follows" in l]
    assert frames == [] and len(pointers) == 2 and str(tmp_path / "node-2.log") in pointers[0], shown
    assert len(shown) == 5, shown
    log = (tmp_path / "node-2.log").read_text()
    assert log.count("frame #") == 31  # all of it kept
    assert router.first_error("node-2") == "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):"
