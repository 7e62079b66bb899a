//! The lease rules' tests: one process on a fake clock ([`Sim`]), launching, completing work
//! and looking when the manager thread would.

use super::*;

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const LEASE_ID: u64 = 7;

/// One process under the lease rules, on a fake clock: the test launches and completes
/// work, and looks when the manager thread would.
struct Sim {
    m: Leases,
    /// The gate's credit counter.
    credits: i64,
    /// Launches returned on the lease's streams.
    total: u64,
    drained: bool,
    waiters: u32,
    loads: Vec<Load>,
    now: u64,
}

impl Sim {
    fn new() -> Self {
        Self {
            m: Leases::default(),
            credits: 0,
            total: 0,
            drained: true,
            waiters: 0,
            loads: Vec::new(),
            now: 0,
        }
    }

    /// A lease of `ms` from the arbiter, asked for and taken over at `at`.
    fn lease(&mut self, ms: u64, at: u64) -> Started {
        let s = self.m.grant(Some((LEASE_ID, ms * MS)), at, at);
        self.credits = s.first;
        let first = self.m.take_over(s, at);
        assert_eq!(
            first,
            Action::Wait {
                tick: TICK,
                mode: WaitMode::Sleep
            },
            "a lease starts with a tick's wait"
        );
        s
    }

    /// `n` launches take credits and return from the driver; their work is in flight.
    fn launch(&mut self, n: u64) {
        self.credits -= n as i64;
        self.total += n;
        self.drained = false;
    }

    /// A look at `at`; a refill is answered at once and the wait after it returned.
    fn look(&mut self, at: u64) -> Action {
        self.now = at;
        let obs = Observation::Look {
            total: self.total,
            credits: self.credits,
            drained: self.drained,
            waiters: self.waiters,
            streams: &self.loads,
        };
        match self.m.step(obs, at) {
            Action::Refill { credits } => {
                let previous = std::mem::replace(&mut self.credits, credits);
                let wait = self.m.step(Observation::Refilled { previous }, at);
                assert!(matches!(wait, Action::Wait { .. }), "{wait:?}");
                wait
            }
            a => a,
        }
    }

    /// Credits to zero after a stop, at `at`: a release, or a drain first.
    fn stop(&mut self, at: u64) -> Action {
        self.now = at;
        let previous = std::mem::replace(&mut self.credits, 0);
        self.m.step(
            Observation::Stopped {
                previous,
                waiters: self.waiters,
            },
            at,
        )
    }
}

fn sleep(us: u64) -> Action {
    Action::Wait {
        tick: Duration::from_micros(us),
        mode: WaitMode::Sleep,
    }
}

fn release(busy_ns: u64, early: bool) -> Action {
    Action::Release {
        lease_id: Some(LEASE_ID),
        busy_ns,
        early,
    }
}

#[test]
fn an_idle_holder_hands_back_after_the_drain_wait_spinning_through_the_last_stretch() {
    let mut s = Sim::new();
    s.lease(20, 0);
    s.launch(1);
    assert_eq!(s.look(500 * US), sleep(500), "launching: the refill tick");
    s.drained = true;
    // Drained at 1 ms; the quiet runs from the launch seen at 0.5 ms: the hand-back is due
    // at 1.5 ms, slept towards while further than the spin.
    assert_eq!(s.look(MS), sleep(500));
    let handed = s.credits;
    assert_eq!(
        s.look(1300 * US),
        Action::Wait {
            tick: Duration::from_micros(200),
            mode: WaitMode::Spin { handed }
        },
        "the last 0.3 ms are spun through, watching the credits handed out"
    );
    assert_eq!(s.look(1500 * US), Action::Stop(End::Idle));
    assert_eq!(
        s.stop(1500 * US),
        release(1500 * US, true),
        "drained and untouched: reported at once, busy until now, early"
    );
    assert_eq!(s.m.deadline(), None, "the lease is over");
}

#[test]
fn the_drain_wait_is_learnt_from_relaunches_and_from_re_requests() {
    let mut s = Sim::new();
    s.lease(20, 0);
    assert_eq!(
        s.m.drain_idle(),
        Some(DRAIN_IDLE),
        "nothing learnt: the floor"
    );
    s.launch(1);
    s.look(200 * US);
    s.drained = true;
    s.look(400 * US);
    // Host work for 0.6 ms after the drain, then the next step's launch.
    s.launch(1);
    s.look(MS);
    s.drained = true;
    s.look(1200 * US);
    // Nothing more: handed back once the (still short) drain wait passed.
    assert_eq!(s.look(2200 * US), Action::Stop(End::Idle));
    assert_eq!(s.stop(2200 * US), release(2200 * US, true));

    // Next lease: twice the 0.6 ms gap, decayed once.
    let start = 10 * MS;
    s.lease(20, start);
    assert_eq!(s.m.drain_idle(), Some(Duration::from_micros(1080)));
    s.launch(1);
    s.look(start + 500 * US);
    s.drained = true;
    s.look(start + 600 * US);
    // Quiet for 1 ms, drained for 0.9 ms: the learnt gap, not idleness.
    assert!(matches!(s.look(start + 1500 * US), Action::Wait { .. }));
    assert_eq!(s.look(start + 1680 * US), Action::Stop(End::Idle));
    assert_eq!(s.stop(start + 1680 * US), release(1680 * US, true));

    // The process asks again 1.4 ms after the drain that preceded that hand-back (at
    // 0.6 ms): the hand-back was premature; the gap is learnt, the drain wait capped.
    let asked = start + 2 * MS;
    let g = s.m.grant(Some((8, 20 * MS)), asked, asked);
    assert_eq!(g.id, Some(8));
    s.m.take_over(g, asked);
    assert_eq!(s.m.drain_idle(), Some(MAX_DRAIN_IDLE));
}

#[test]
fn a_re_request_soon_after_an_early_hand_back_lengthens_the_drain_wait() {
    let mut s = Sim::new();
    s.lease(20, 0);
    // Nothing launched: drained from the first look, quiet since the grant.
    assert!(matches!(s.look(1000 * US), Action::Wait { .. }));
    assert_eq!(s.look(1250 * US), Action::Stop(End::Idle));
    assert_eq!(s.stop(1250 * US), release(1250 * US, true));
    // Drained at 1 ms, asked again at 2 ms: the 1 ms gap is the work's.
    let g = s.m.grant(Some((8, 20 * MS)), 2 * MS, 2 * MS);
    s.m.take_over(g, 2 * MS);
    assert_eq!(s.m.drain_idle(), Some(Duration::from_micros(1800)));
    // A pause longer than the longest drain wait is no gap: nothing more learnt.
    let mut s = Sim::new();
    s.lease(20, 0);
    s.look(1000 * US);
    s.look(1250 * US);
    s.stop(1250 * US);
    let g = s.m.grant(Some((8, 20 * MS)), 5 * MS, 5 * MS);
    s.m.take_over(g, 5 * MS);
    assert_eq!(s.m.drain_idle(), Some(DRAIN_IDLE));
}

#[test]
fn a_latency_lease_hands_back_at_its_drain_and_learns_no_gap_from_the_next_request() {
    let mut s = Sim::new();
    let g = s.m.grant_latency((LEASE_ID, 20 * MS), 0, 0);
    s.credits = g.first;
    s.m.take_over(g, 0);
    assert_eq!(
        s.m.drain_idle(),
        Some(LATENCY_DRAIN_IDLE),
        "a latency holder's floor"
    );
    // A request: launched at once, drained at 8 ms, quiet since: handed back 50 us later.
    s.launch(4);
    s.look(500 * US);
    s.drained = true;
    assert!(matches!(s.look(8 * MS), Action::Wait { .. }));
    assert_eq!(s.look(8 * MS + 50 * US), Action::Stop(End::Idle));
    assert_eq!(s.stop(8 * MS + 50 * US), release(8 * MS + 50 * US, true));
    // The next request 0.5 ms after that drain: a client's timing, not the work's gap. A
    // plain holder would learn it (the test above: 1.8 ms for a 1 ms gap); this one does not.
    let asked = 8 * MS + 500 * US;
    let g = s.m.grant_latency((8, 20 * MS), asked, asked);
    s.m.take_over(g, asked);
    assert_eq!(s.m.drain_idle(), Some(LATENCY_DRAIN_IDLE));
    // A request in two synchronised steps, 0.3 ms of host work between them, inside the
    // lease: that gap is learnt, so the next lease waits it out (twice it, decayed once).
    let t = asked;
    s.launch(1);
    s.look(t + 100 * US);
    s.drained = true;
    s.look(t + 200 * US);
    s.launch(1);
    s.look(t + 500 * US);
    s.drained = true;
    s.look(t + 1500 * US);
    assert_eq!(s.look(t + 1600 * US), Action::Stop(End::Idle));
    s.stop(t + 1600 * US);
    let asked = t + 10 * MS;
    let g = s.m.grant_latency((9, 20 * MS), asked, asked);
    s.m.take_over(g, asked);
    assert_eq!(s.m.drain_idle(), Some(Duration::from_micros(540)));
}

#[test]
fn launches_and_waiters_cancel_a_pending_hand_back() {
    let mut s = Sim::new();
    s.lease(20, 0);
    s.launch(1);
    s.look(500 * US);
    s.drained = true;
    s.look(MS);
    assert!(matches!(
        s.look(1300 * US),
        Action::Wait {
            mode: WaitMode::Spin { .. },
            ..
        }
    ));
    // A credit taken during the spin (the launch has not returned from the driver yet).
    s.credits -= 1;
    assert_eq!(
        s.look(1500 * US),
        sleep(500),
        "launching again: no hand-back"
    );
    // It returns and completes; a thread now waits for a credit.
    s.total += 1;
    s.drained = true;
    s.waiters = 1;
    s.look(2 * MS);
    assert_eq!(
        s.look(4 * MS),
        sleep(500),
        "drained and quiet, but a launcher waits: kept, at the refill tick"
    );
    s.waiters = 0;
    assert_eq!(s.look(5 * MS), Action::Stop(End::Idle));
    assert_eq!(s.stop(5 * MS), release(5 * MS, true));
}

#[test]
fn a_credit_taken_between_a_look_and_its_refill_cancels_the_drain() {
    let mut s = Sim::new();
    s.lease(20, 0);
    s.launch(1);
    s.look(500 * US);
    s.drained = true;
    let look = Observation::Look {
        total: s.total,
        credits: s.credits,
        drained: true,
        waiters: 0,
        streams: &[],
    };
    let Action::Refill { credits } = s.m.step(look, 2 * MS) else {
        panic!("a refill")
    };
    // The counter the refill replaced is one lower than handed out: a launch under way.
    let previous = s.credits - 1;
    s.credits = credits;
    s.m.step(Observation::Refilled { previous }, 2 * MS);
    s.total += 1;
    s.drained = false;
    // Without the cancellation the drain seen at 2 ms would hand back here.
    assert_eq!(s.look(2400 * US), sleep(500));
    s.drained = true;
    s.look(2500 * US);
    assert_eq!(s.look(3500 * US), Action::Stop(End::Idle));
}

#[test]
fn the_deadline_ends_a_busy_lease_and_its_overrun_is_charged() {
    let mut s = Sim::new();
    s.lease(2, 0);
    s.launch(3);
    s.look(500 * US);
    s.launch(3);
    s.look(MS);
    s.launch(3);
    assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
    assert_eq!(
        s.stop(2 * MS),
        Action::Drain,
        "work in flight: the report waits for it"
    );
    // The last kernel completes 1.5 ms past the deadline: charged.
    let end = s.m.step(Observation::Drained { waiters: 1 }, 3500 * US);
    assert_eq!(end, release(3500 * US, false));
}

#[test]
fn a_drained_holder_at_its_deadline_is_reported_early_only_when_idle() {
    // Drained long before the deadline but a launcher waiting: kept, then not early.
    let mut s = Sim::new();
    s.lease(2, 0);
    s.launch(1);
    s.look(100 * US);
    s.drained = true;
    s.waiters = 1;
    s.look(200 * US);
    s.look(1500 * US);
    assert_eq!(s.look(1700 * US), Action::Stop(End::UsedUp));
    assert_eq!(s.stop(1700 * US), release(1700 * US, false));
    // The drain first seen at the deadline, quiet and nobody waiting: early.
    let mut s = Sim::new();
    s.lease(2, 0);
    s.launch(1);
    s.look(1000 * US);
    s.drained = true;
    assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
    assert_eq!(s.stop(2100 * US), release(2100 * US, true));
    // Not drained at the deadline (a synchronise pending): drained later, not early.
    let mut s = Sim::new();
    s.lease(2, 0);
    s.launch(1);
    s.look(500 * US);
    assert_eq!(s.look(2 * MS), Action::Stop(End::Deadline));
    assert_eq!(s.stop(2 * MS), Action::Drain);
    let end = s.m.step(Observation::Drained { waiters: 0 }, 2100 * US);
    assert_eq!(end, release(2100 * US, false));
}

#[test]
fn a_used_up_lease_ends_before_its_deadline() {
    let mut s = Sim::new();
    s.lease(10, 0);
    s.launch(1);
    s.look(9500 * US);
    s.drained = true;
    assert_eq!(
        s.look(9750 * US),
        Action::Stop(End::UsedUp),
        "drained with 0.25 ms left: under the margin"
    );
    assert_eq!(s.stop(9750 * US), release(9750 * US, false));
}

#[test]
fn a_credit_taken_at_the_stop_makes_the_report_wait_for_the_drain() {
    let mut s = Sim::new();
    s.lease(10, 0);
    s.launch(1);
    s.look(9500 * US);
    s.drained = true;
    assert_eq!(s.look(9750 * US), Action::Stop(End::UsedUp));
    s.credits -= 1;
    assert_eq!(s.stop(9750 * US), Action::Drain);
    let end = s.m.step(Observation::Drained { waiters: 0 }, 11 * MS);
    assert_eq!(end, release(11 * MS, false));
}

#[test]
fn the_first_look_counts_the_quiet_from_the_grant() {
    // The launcher's work completed before the manager took the lease over (at 0.9 ms):
    // quiet since the grant, so the hand-back needs only the drain wait.
    let mut s = Sim::new();
    let g = s.m.grant(Some((LEASE_ID, 20 * MS)), 0, 0);
    s.credits = g.first - 1;
    s.total = 1;
    s.m.take_over(g, 900 * US);
    assert!(matches!(s.look(MS), Action::Wait { .. }));
    assert_eq!(s.look(1250 * US), Action::Stop(End::Idle));
    // Still in flight at the first look: the quiet runs from that look.
    let mut s = Sim::new();
    let g = s.m.grant(Some((LEASE_ID, 20 * MS)), 0, 0);
    s.m.take_over(g, 900 * US);
    s.launch(1);
    assert_eq!(s.look(MS), sleep(500));
    s.drained = true;
    assert_eq!(s.look(1250 * US), sleep(500));
    assert_eq!(s.look(2 * MS), Action::Stop(End::Idle));
}

#[test]
fn launches_stopped_with_work_in_flight_are_watched_for_the_drain() {
    let mut s = Sim::new();
    s.lease(20, 0);
    s.launch(2);
    s.look(500 * US);
    assert_eq!(
        s.look(MS),
        Action::Wait {
            tick: DRAIN_TICK,
            mode: WaitMode::Watch
        },
        "no launch since, not drained: a synchronise may end the wait"
    );
}

#[test]
fn refills_keep_the_estimated_work_in_flight_within_the_lease() {
    let mut s = Sim::new();
    let g = s.lease(20, 0);
    assert_eq!(g.first, 1, "nothing measured: one probe launch");
    s.launch(1);
    // The probe is in flight, its cost unknown: no second one.
    s.loads = vec![Load {
        in_flight: 1,
        est_ns: 0.0,
        running_ns: 0.0,
    }];
    s.look(100 * US);
    assert_eq!(s.credits, 0);
    // Measured: 1 ms per launch, 5 in flight on one stream, 2 of unknown cost on another
    // (counted at the known pace): 19.9 - 5 - 2 - 0.3 ms of room at 0.1 ms.
    s.loads = vec![
        Load {
            in_flight: 5,
            est_ns: 1e6,
            running_ns: 0.0,
        },
        Load {
            in_flight: 2,
            est_ns: 0.0,
            running_ns: 0.0,
        },
    ];
    s.total += 6;
    s.look(100 * US);
    assert_eq!(s.credits, 12);
    assert_eq!(
        s.m.default_est(),
        1e6,
        "the largest estimate is the default"
    );
    // The next lease starts from what was learnt.
    s.drained = true;
    s.loads.clear();
    let _ = s.look(19_800 * US);
    let g = s.m.grant(Some((8, 10 * MS)), 30 * MS, 30 * MS);
    assert_eq!(g.first, 9, "9.7 ms of room at 1 ms a launch");
}

#[test]
fn an_unreachable_arbiter_gets_a_local_lease() {
    let mut s = Sim::new();
    let g = s.m.grant(None, 0, 3 * MS);
    assert_eq!(
        g,
        Started {
            id: None,
            duration_ns: ns(LOCAL_LEASE),
            start: 3 * MS,
            first: 1,
            max_inflight_ns: None,
            latency: false,
        }
    );
    s.credits = g.first;
    s.m.take_over(g, 3 * MS);
    assert_eq!(s.m.deadline(), Some(103 * MS));
    s.look(4 * MS);
    assert_eq!(s.look(5 * MS), Action::Stop(End::Idle));
    assert_eq!(
        s.stop(5 * MS),
        Action::Release {
            lease_id: None,
            busy_ns: 2 * MS,
            early: true
        },
        "a local lease has no id to report"
    );
}

#[test]
#[should_panic(expected = "a look out of turn")]
fn a_look_during_a_refill_is_a_bug() {
    let mut s = Sim::new();
    s.lease(20, 0);
    let look = Observation::Look {
        total: 0,
        credits: 1,
        drained: false,
        waiters: 0,
        streams: &[],
    };
    s.m.step(look, 100 * US);
    s.m.step(look, 200 * US);
}

#[test]
fn the_drain_wait_follows_the_relaunch_gap() {
    let mut g = RelaunchGap::default();
    assert_eq!(g.drain_idle(), DRAIN_IDLE, "nothing learnt: the floor");
    g.observe(Duration::from_micros(40));
    assert_eq!(
        g.drain_idle(),
        DRAIN_IDLE,
        "a prompt relaunch keeps the floor"
    );
    g.observe(Duration::from_micros(600));
    assert_eq!(
        g.drain_idle(),
        Duration::from_micros(1200),
        "twice the longest recent gap"
    );
    g.observe(Duration::from_micros(300));
    assert_eq!(
        g.drain_idle(),
        Duration::from_micros(1200),
        "a shorter gap does not lower it"
    );
    g.observe(Duration::from_millis(40));
    assert_eq!(
        g.drain_idle(),
        Duration::from_micros(1200),
        "a real pause is not a gap"
    );
    g.observe(Duration::from_micros(1500));
    assert_eq!(g.drain_idle(), MAX_DRAIN_IDLE, "capped");
    for _ in 0..40 {
        g.decay();
    }
    assert_eq!(
        g.drain_idle(),
        DRAIN_IDLE,
        "forgotten after a few dozen leases"
    );
}

#[test]
fn a_lease_ending_on_an_idle_holder_is_reported_early() {
    let long = IDLE + Duration::from_micros(1);
    let now = Some(Duration::ZERO);
    assert!(
        idle_at_end(now, DRAIN_IDLE, true, 0, long),
        "drained, quiet, nobody waiting"
    );
    assert!(
        !idle_at_end(None, DRAIN_IDLE, true, 0, long),
        "work in flight (a synchronise pending)"
    );
    assert!(
        !idle_at_end(now, DRAIN_IDLE, false, 0, long),
        "a credit was taken since the last look"
    );
    assert!(
        !idle_at_end(now, DRAIN_IDLE, true, 1, long),
        "a launcher waits for the next lease"
    );
    assert!(
        !idle_at_end(now, DRAIN_IDLE, true, 0, IDLE / 2),
        "launched just now"
    );
    // A process seen to work 0.6 ms on the host between its drains and launches (drain
    // wait 1.2 ms): drained 0.3 ms is its gap, not idleness; drained 1 ms is.
    let learnt = Duration::from_micros(1200);
    assert!(!idle_at_end(
        Some(Duration::from_micros(300)),
        learnt,
        true,
        0,
        long
    ));
    assert!(idle_at_end(
        Some(Duration::from_millis(1)),
        learnt,
        true,
        0,
        long
    ));
}

#[test]
fn credits_bound_the_work_in_flight() {
    let ms = Duration::from_millis;
    // Nothing known: one probe at a time.
    assert_eq!(credits_for(0.0, ms(20), 0.0, 0), 1);
    assert_eq!(credits_for(0.0, ms(20), 0.0, 1), 0);
    // 1 ms kernels, 20 ms left, 5 ms in flight: 14.7 ms of room = 14 launches.
    assert_eq!(credits_for(1e6, ms(20), 5e6, 0), 14);
    // Launches of unknown cost count at the known pace.
    assert_eq!(credits_for(1e6, ms(20), 5e6, 2), 12);
    // No room left: none.
    assert_eq!(credits_for(1e6, ms(2), 5e6, 0), 0);
    // A kernel longer than the lease still gets one launch when nothing is in flight.
    assert_eq!(credits_for(30e6, ms(20), 0.0, 0), 1);
    assert_eq!(credits_for(30e6, ms(20), 30e6, 0), 0);
    // Tiny kernels: capped.
    assert_eq!(credits_for(10.0, ms(100), 0.0, 0), MAX_CREDITS);
}

#[test]
fn a_bounded_holder_keeps_at_most_its_bound_in_flight_whatever_the_lease_has_left() {
    let mut s = Sim::new();
    // A 20 ms lease bounded at 1 ms in flight, with 0.2 ms launches measured.
    let g = s.m.grant_bounded(Some((LEASE_ID, 20 * MS)), Some(MS), 0, 0);
    assert_eq!(g.first, 1, "nothing measured: one probe launch");
    s.credits = g.first;
    s.m.take_over(g, 0);
    s.launch(1);
    s.loads = vec![Load {
        in_flight: 1,
        est_ns: 200_000.0,
        running_ns: 0.0,
    }];
    s.look(100 * US);
    // 1 ms - 0.2 in flight: 0.8 ms of room, 4 launches (no end-of-lease margin in a
    // bound; unbounded: 19.4 ms of room, 97).
    assert_eq!(s.credits, 4);
    // Nothing in flight: still one launch at least, even one longer than the bound.
    s.loads = vec![Load {
        in_flight: 0,
        est_ns: 5e6,
        running_ns: 0.0,
    }];
    s.total += 1;
    s.look(200 * US);
    assert_eq!(s.credits, 1, "a 5 ms kernel alone, not 3");
    // The next lease without a bound is back to the lease's length.
    let g = s.m.grant(Some((8, 20 * MS)), 30 * MS, 30 * MS);
    assert!(g.first >= 3, "{}", g.first);
}

#[test]
fn a_bounded_holder_queues_the_next_kernel_before_the_running_one_ends() {
    // 0.55 ms kernels under a 1 ms bound: one in flight leaves 0.45 ms, no room for a
    // second; once it has run 0.3 ms (0.25 left), the next fits, so the GPU does not idle
    // between them waiting for the manager to see the completion.
    let mut s = Sim::new();
    let g = s.m.grant_bounded(Some((LEASE_ID, 20 * MS)), Some(MS), 0, 0);
    s.credits = g.first;
    let first = s.m.take_over(g, 0);
    assert_eq!(
        first,
        Action::Wait {
            tick: BOUNDED_TICK,
            mode: WaitMode::Sleep
        },
        "a bounded lease is looked at every 0.1 ms"
    );
    s.launch(1);
    let load = |running_ns: f64| Load {
        in_flight: 1,
        est_ns: 550_000.0,
        running_ns,
    };
    s.loads = vec![load(0.0)];
    let wait = s.look(100 * US);
    assert_eq!(s.credits, 0, "just started: no room");
    assert!(
        matches!(wait, Action::Wait { tick, .. } if tick <= BOUNDED_TICK),
        "{wait:?}"
    );
    s.loads = vec![load(300_000.0)];
    s.look(400 * US);
    assert_eq!(s.credits, 1, "0.25 ms left to run: the next is queued");
    // Its part run counts at most its estimate: a stale head (the sample covering it not
    // yet done) is taken for one with nothing left to run, never for less than nothing.
    s.loads = vec![Load {
        in_flight: 2,
        est_ns: 550_000.0,
        running_ns: 5e6,
    }];
    s.total += 1;
    s.look(500 * US);
    assert_eq!(
        s.credits, 0,
        "0.55 ms of the second still to run: 0.45 ms of room"
    );
    // Two streams busy share the context's engine time: their wall time is not progress.
    s.loads = vec![load(300_000.0), load(300_000.0)];
    s.total += 1;
    s.look(600 * US);
    assert_eq!(s.credits, 0);
    // Past its estimate the running kernel is not taken for done: with a 0.55 ms estimate
    // the next still fits beside it, ...
    s.loads = vec![load(900_000.0)];
    s.total += 1;
    s.look(1_400 * US);
    assert_eq!(s.credits, 1, "a short next kernel fits the bound");
    // ... but a 5.5 ms one (1-10 ms kernels) waits for the running one to end: a latency
    // request arriving then meets one kernel's remainder, not two kernels.
    s.loads = vec![Load {
        in_flight: 1,
        est_ns: 5.5e6,
        running_ns: 7e6,
    }];
    s.total += 1;
    s.look(8 * MS);
    assert_eq!(
        s.credits, 0,
        "a long kernel past its estimate: nothing queued behind"
    );
    s.loads = vec![];
    s.total += 1;
    s.look(9 * MS);
    assert_eq!(s.credits, 1, "it ended: the next runs alone");
    assert_eq!(bounded_credits(550_000.0, 1e6, 250_000.0, 0), 1);
    assert_eq!(bounded_credits(0.0, 1e6, 0.0, 0), 1, "one probe");
    assert_eq!(bounded_credits(5e6, 1e6, 0.0, 0), 1, "a long kernel alone");
    assert_eq!(bounded_credits(5e6, 1e6, 4e6, 0), 0);
}

#[test]
fn a_revoked_lease_stops_at_the_next_look_and_another_ids_revocation_is_stale() {
    let mut s = Sim::new();
    s.lease(20, 0);
    s.launch(3);
    s.loads = vec![Load {
        in_flight: 3,
        est_ns: 1e6,
        running_ns: 0.0,
    }];
    assert!(matches!(s.look(500 * US), Action::Wait { .. }));
    assert!(!s.m.revoke(LEASE_ID + 1, 600 * US), "not the running lease");
    assert!(matches!(s.look(1_000 * US), Action::Wait { .. }));
    assert!(s.m.revoke(LEASE_ID, 1_100 * US));
    assert_eq!(s.m.deadline(), Some(1_100 * US), "ends now, not at 20 ms");
    assert_eq!(s.look(1_200 * US), Action::Stop(End::Deadline));
    // Work in flight: the drain, then the release (which the arbiter ignores).
    assert_eq!(s.stop(1_200 * US), Action::Drain);
    let r = s.m.step(Observation::Drained { waiters: 1 }, 3_000 * US);
    assert!(
        matches!(
            r,
            Action::Release {
                lease_id: Some(LEASE_ID),
                early: false,
                ..
            }
        ),
        "{r:?}"
    );
    assert!(!s.m.revoke(LEASE_ID, 3_100 * US), "over: nothing to revoke");
}
