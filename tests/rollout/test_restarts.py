"""A child that keeps dying is restarted with backoff, and the node is called degraded."""

from belayer.rollout.restarts import BACKOFF_MAX_S, DEGRADED_AFTER, STABLE_S, Restarts


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_first_restart_is_immediate_then_backoff_doubles_and_degrades():
    clock = Clock()
    restarts = Restarts("shadow", "serving with the leader alone", clock)
    delays = []
    for _ in range(DEGRADED_AFTER):
        assert restarts.due()
        restarts.started()
        delays.append(restarts.died("exited with -9 while starting"))
        clock.now += delays[-1]
    assert delays == [0.0, 1.0, 2.0]
    assert restarts.degraded.startswith("the shadow failed 3 times in a row (last: exited with -9")
    assert "serving with the leader alone" in restarts.degraded
    restarts.died("again")
    assert not restarts.due() and restarts.next_start_at - clock.now == 4.0
    for _ in range(20):
        clock.now += restarts.died("again")
    assert restarts.died("again") == BACKOFF_MAX_S


def test_a_ready_child_clears_degraded_and_a_stable_one_resets_the_count():
    clock = Clock()
    restarts = Restarts("memory owner", "the engines serve from their own memory", clock)
    for _ in range(DEGRADED_AFTER):
        restarts.died("x")
    restarts.ready()
    assert restarts.degraded is None
    clock.now += STABLE_S + 1
    assert restarts.died("killed after an hour of service") == 0.0  # a new failure, not a loop
