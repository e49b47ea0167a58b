"""The supervisor's state machine, transition by transition, with no process started: what a
poll means and what follows a job's end (tests/test_launch.py runs it with real processes)."""

import signal

import pytest

from jaxtron.supervisor.machine import (
    USER_ERROR,
    Finish,
    GiveUp,
    Grow,
    Phase,
    Poll,
    Restart,
    Supervision,
    UserError,
    backoff_s,
    describe_exit,
)

RUNNING = None


def started(machine, now=0.0, resume_from=0, logged=0):
    machine.job_started(now, resume_from, logged)
    return machine


def test_every_process_exiting_at_the_target_step_finishes_the_job():
    m = started(Supervision(3, 60, target_steps=10))
    m.poll(Poll((RUNNING, 0), logged_step=9, now=1))
    assert m.phase is Phase.RUNNING  # one process still runs
    m.poll(Poll((0, 0), logged_step=10, now=2))
    assert m.phase is Phase.FINISHED and not m.live


def test_a_job_that_exits_0_before_its_target_is_restarted():
    m = started(Supervision(3, 60, target_steps=10))
    m.poll(Poll((0, 0), logged_step=6, now=1))
    assert m.phase is Phase.ENDED and m.reason == "the job stopped at step 6 of 10"
    outcome = m.after_job(newest_checkpoint=5, logged_step=6, now=2)
    assert outcome == Restart(1, "the job stopped at step 6 of 10", lost_steps=1, resume_from=5,
                              backoff_s=1)


def test_a_process_killed_by_a_signal_is_blamed_before_one_that_exited_with_an_error():
    m = started(Supervision(3, 60))
    m.poll(Poll((1, -signal.SIGKILL, RUNNING), logged_step=0, now=1))
    assert m.reason == "process 1 was killed by SIGKILL" and m.cause == 1
    assert m.status == -signal.SIGKILL


def test_a_bad_input_is_not_retried():
    m = started(Supervision(3, 60))
    m.poll(Poll((USER_ERROR,), logged_step=0, now=1))
    assert m.after_job(0, 0, now=2) == UserError("process 0 exited with status 2")
    assert m.restarts == 0


def test_restarts_back_off_and_run_out():
    m = Supervision(2, 60)
    outcomes = []
    for attempt in range(3):
        started(m, now=10 * attempt)
        m.poll(Poll((3,), logged_step=0, now=10 * attempt + 1))
        outcomes.append(m.after_job(0, 0, now=10 * attempt + 2))
    assert [o.backoff_s for o in outcomes[:2]] == [1, 2]
    assert outcomes[2] == GiveUp("process 0 exited with status 3", restarts=2)
    assert [backoff_s(n) for n in (1, 2, 3, 6, 7)] == [1, 2, 4, 30, 30]


def test_no_new_step_for_the_stall_timeout_ends_the_job():
    m = started(Supervision(1, stall_timeout_s=5), logged=3)
    m.poll(Poll((RUNNING,), logged_step=4, now=4))  # progress resets the clock
    m.poll(Poll((RUNNING,), logged_step=4, now=8.9))
    assert m.phase is Phase.RUNNING
    m.poll(Poll((RUNNING,), logged_step=4, now=9.1))
    assert m.phase is Phase.ENDED and m.reason == "no step logged for 5 s" and m.status is None


def test_lost_steps_and_the_recovery_time_after_a_restart():
    m = started(Supervision(3, 60), resume_from=4, logged=4)
    m.poll(Poll((RUNNING, -signal.SIGKILL), logged_step=7, now=20))
    restart = m.after_job(newest_checkpoint=4, logged_step=7, now=21)
    assert restart.lost_steps == 3 and restart.resume_from == 4 and m.lost_total == 3
    started(m, now=22, resume_from=4, logged=7)
    # steps 5-7 logged again are not yet new work; step 8 is
    assert m.poll(Poll((RUNNING, RUNNING), logged_step=7, now=30)).recovered_s is None
    assert m.poll(Poll((RUNNING, RUNNING), logged_step=8, now=31.04)).recovered_s == 10.0
    assert m.failed_at is None


def test_the_same_culprit_twice_in_a_row_is_dropped_then_the_job_grows_back():
    m = Supervision(5, stall_timeout_s=1000, target_steps=100, drop_after=2, grow_after_s=100)
    for now in (0, 10):
        started(m, now=now)
        m.poll(Poll((RUNNING, 1), logged_step=0, now=now + 1))
        restart = m.after_job(0, 0, now=now + 2)
    assert restart.shrink == 1  # process 1 failed twice in a row
    m.shrunk(now=12)
    started(m, now=13)
    m.poll(Poll((RUNNING,), logged_step=1, now=14))  # the shrunk job runs steps: clock restarts
    assert not m.poll(Poll((RUNNING,), logged_step=1, now=113)).stop_to_grow
    asked = m.poll(Poll((RUNNING,), logged_step=1, now=114.5))
    assert asked.stop_to_grow and m.phase is Phase.STOPPING_TO_GROW
    assert not m.poll(Poll((RUNNING,), logged_step=1, now=115)).stop_to_grow  # asked once
    m.poll(Poll((0,), logged_step=2, now=116))  # it saved a step and exited
    assert m.after_job(newest_checkpoint=2, logged_step=2, now=117) == Grow()
    assert m.restarts == 2 and m.shrunk_at is None


def test_different_culprits_are_not_dropped():
    m = Supervision(5, 60, drop_after=2)
    for now, rank in ((0, 1), (10, 0)):
        started(m, now=now)
        statuses = [RUNNING, RUNNING]
        statuses[rank] = 1
        m.poll(Poll(tuple(statuses), logged_step=0, now=now + 1))
        restart = m.after_job(0, 0, now=now + 2)
    assert restart.shrink is None and m.in_a_row == 1


def test_srun_names_the_node_a_failure_is_blamed_on():
    m = started(Supervision(3, 60, blame=lambda rank: "node7"))
    m.poll(Poll((1,), logged_step=0, now=1))
    assert m.reason == "process 0 exited with status 1 (srun: a task failed on node7)"
    assert m.cause == "node7"


def test_a_job_that_ended_as_it_finished_needs_no_restart():
    """A process failing after the final checkpoint was written."""
    m = started(Supervision(0, 60, target_steps=10))
    m.poll(Poll((-signal.SIGKILL,), logged_step=10, now=1))
    assert m.after_job(newest_checkpoint=10, logged_step=10, now=2) == Finish()


@pytest.mark.parametrize("status, text", [(1, "process 3 exited with status 1"),
                                          (-signal.SIGTERM, "process 3 was killed by SIGTERM")])
def test_exit_descriptions(status, text):
    assert describe_exit(3, status) == text
