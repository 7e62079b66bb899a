//! Time-slicing between contexts, as a GPU without MPS shares its engine: one context runs at a
//! time; while others have work the running one is switched out after a time slice, and the
//! next context in round-robin order runs; a context with no work is never waited for. The
//! NVIDIA open kernel driver's default timeslice for a channel group on Volta and later is
//! 1024 us; a context switch costs tens of microseconds (30-100 us measured). Defaults here:
//! [`Params::default`], a 1 ms slice and a 50 us switch.
//!
//! The pure rules: a worker holding the engine's lock, with part of a kernel left, asks
//! [`step`] what to do (run a chunk, or wait: it is [`owner`]'s turn), and records what it ran
//! with [`Turn::ran`]. The engine (module `engine`) keeps the
//! [`Turn`] in its shared file, so the rules hold across processes; a context is a process
//! here (each simulated process has one engine identity per device).

/// Time-slice settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// Longest a context runs while another has work, ns.
    pub quantum_ns: u64,
    /// Engine time lost when the running context changes, ns.
    pub switch_ns: u64,
}

impl Default for Params {
    fn default() -> Self {
        Self {
            quantum_ns: 1_000_000,
            switch_ns: 50_000,
        }
    }
}

impl Params {
    /// Reads a setting of `TESSERA_SIM_TIMESLICE`: `off` is none (whole kernels in turn, first
    /// come first served), empty (unset) or `on` the defaults, as a GPU without MPS
    /// time-slices whatever one asks, `QUANTUM[,SWITCH]` with a unit each (`ns`, `us`, `ms`), e.g.
    /// `1ms,50us` or `2ms`.
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        let text = text.trim();
        match text {
            "off" => return Ok(None),
            "" | "on" => return Ok(Some(Self::default())),
            _ => {}
        }
        let duration = |t: &str| -> Result<u64, String> {
            let t = t.trim();
            let (num, mult) = if let Some(n) = t.strip_suffix("ns") {
                (n, 1)
            } else if let Some(n) = t.strip_suffix("us") {
                (n, 1_000)
            } else if let Some(n) = t.strip_suffix("ms") {
                (n, 1_000_000)
            } else {
                return Err(format!("{t:?} needs a unit: ns, us or ms"));
            };
            let v: f64 = num
                .trim()
                .parse()
                .map_err(|_| format!("{t:?} is not a duration"))?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{t:?} is not a duration"));
            }
            Ok((v * mult as f64).round() as u64)
        };
        let mut parts = text.split(',');
        let quantum_ns = duration(parts.next().unwrap_or(""))?;
        if quantum_ns == 0 {
            return Err("the time slice must be longer than 0".into());
        }
        let switch_ns = match parts.next() {
            Some(t) => duration(t)?,
            None => Self::default().switch_ns,
        };
        if parts.next().is_some() {
            return Err(format!("{text:?}: expected QUANTUM[,SWITCH]"));
        }
        Ok(Some(Self {
            quantum_ns,
            switch_ns,
        }))
    }
}

/// The engine's turn, shared by every worker of every context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Turn {
    /// The context that ran last (0: none yet).
    pub last: u64,
    /// How long `last` has run since it got the engine, ns.
    pub used_ns: u64,
}

/// What a worker holding the engine's lock does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Run `chunk_ns` of its kernel, after `switch_ns` of context switch.
    Run {
        /// Switch time first (0 when the engine already ran this context).
        switch_ns: u64,
        /// Kernel time to run now.
        chunk_ns: u64,
    },
    /// Another context's turn: let go of the lock and wait for the turn to change.
    Wait,
}

/// The next context after `me` in round-robin order among `waiting` (contexts with work, in a
/// fixed order), or `None` when no other has work.
pub fn next_after(waiting: &[u64], me: u64) -> Option<u64> {
    let others = || waiting.iter().copied().filter(move |&c| c != me);
    others()
        .filter(|&c| c > me)
        .min()
        .or_else(|| others().min())
}

/// Whose turn it is, given the contexts with work (`None`: anyone's, the engine never ran).
/// The last context keeps the engine while it has work and its slice lasts; then the next
/// context with work in round-robin order after it gets it; alone, the last one goes on.
pub fn owner(p: &Params, turn: &Turn, waiting: &[u64]) -> Option<u64> {
    if turn.last == 0 {
        return None;
    }
    let last_waits = waiting.contains(&turn.last);
    if last_waits && turn.used_ns < p.quantum_ns {
        return Some(turn.last);
    }
    next_after(waiting, turn.last).or(last_waits.then_some(turn.last))
}

/// What a worker of context `me` with `remaining_ns` of its kernel left does, holding the
/// lock, given the turn and the contexts that have work now (`waiting`, `me` among them).
/// It runs at most the rest of its slice, so a context that gets work is seen within one
/// slice; a worker whose turn it is not waits, whichever worker the lock woke first.
pub fn step(p: &Params, turn: &Turn, me: u64, remaining_ns: u64, waiting: &[u64]) -> Step {
    if owner(p, turn, waiting).is_some_and(|o| o != me) {
        return Step::Wait;
    }
    let mine = turn.last == me;
    let switch_ns = if mine || turn.last == 0 {
        0
    } else {
        p.switch_ns
    };
    let used = if mine { turn.used_ns } else { 0 };
    // Alone past its slice, it runs a fresh one.
    let left = if used >= p.quantum_ns {
        p.quantum_ns
    } else {
        p.quantum_ns - used
    };
    Step::Run {
        switch_ns,
        chunk_ns: remaining_ns.min(left.max(1)),
    }
}

impl Turn {
    /// After `me` ran `chunk_ns` (the step's `Run`): it holds the turn and its slice grows; a
    /// context running on alone past its slice starts a new one.
    pub fn ran(&mut self, p: &Params, me: u64, chunk_ns: u64) {
        if self.last == me && self.used_ns < p.quantum_ns {
            self.used_ns = self.used_ns.saturating_add(chunk_ns);
        } else {
            self.last = me;
            self.used_ns = chunk_ns;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    /// A fake engine: contexts with kernels queued (each a length, arriving at a time), run to
    /// completion under the rules, with the lock given to whichever allowed worker `pick`
    /// names. Returns each kernel's (context, arrival, end) and the engine's timeline of runs.
    struct Sim {
        p: Params,
        turn: Turn,
        now: u64,
        /// (context, arrival, remaining, original length)
        queue: Vec<(u64, u64, u64, u64)>,
        done: Vec<(u64, u64, u64)>,
        runs: Vec<(u64, u64, u64)>,
        switches: u64,
    }

    impl Sim {
        fn new(p: Params, kernels: &[(u64, u64, u64)]) -> Self {
            Self {
                p,
                turn: Turn::default(),
                now: 0,
                queue: kernels.iter().map(|&(c, at, ns)| (c, at, ns, ns)).collect(),
                done: Vec::new(),
                runs: Vec::new(),
                switches: 0,
            }
        }

        /// Contexts with a kernel arrived and unfinished, each once, in order.
        fn waiting(&self) -> Vec<u64> {
            let mut w: Vec<u64> = self
                .queue
                .iter()
                .filter(|k| k.1 <= self.now)
                .map(|k| k.0)
                .collect();
            w.sort_unstable();
            w.dedup();
            w
        }

        /// Runs until every kernel is done; `pick` chooses which waiting context takes the lock
        /// first (an adversarial lock).
        fn run(mut self, pick: impl Fn(&[u64]) -> Vec<u64>) -> Self {
            let mut guard = 0;
            while !self.queue.is_empty() {
                guard += 1;
                assert!(guard < 1_000_000, "no progress");
                let waiting = self.waiting();
                if waiting.is_empty() {
                    self.now = self.queue.iter().map(|k| k.1).min().unwrap();
                    continue;
                }
                let mut progressed = false;
                for c in pick(&waiting) {
                    // FIFO within a context: its first arrived kernel.
                    let i = self
                        .queue
                        .iter()
                        .position(|k| k.0 == c && k.1 <= self.now)
                        .unwrap();
                    match step(&self.p, &self.turn, c, self.queue[i].2, &waiting) {
                        Step::Wait => continue,
                        Step::Run {
                            switch_ns,
                            chunk_ns,
                        } => {
                            if switch_ns > 0 {
                                self.switches += 1;
                            }
                            self.now += switch_ns;
                            self.runs.push((c, self.now, chunk_ns));
                            self.now += chunk_ns;
                            self.turn.ran(&self.p, c, chunk_ns);
                            self.queue[i].2 -= chunk_ns;
                            if self.queue[i].2 == 0 {
                                let (c, at, _, _) = self.queue.remove(i);
                                self.done.push((c, at, self.now));
                            }
                            progressed = true;
                            break;
                        }
                    }
                }
                assert!(
                    progressed,
                    "every waiting worker was told to wait: {waiting:?}"
                );
            }
            self
        }

        fn busy_of(&self, c: u64, until: u64) -> u64 {
            self.runs
                .iter()
                .filter(|r| r.0 == c)
                .map(|r| (r.1 + r.2).min(until).saturating_sub(r.1))
                .sum()
        }
    }

    #[test]
    fn a_context_alone_runs_its_kernel_through_without_a_switch() {
        let s = Sim::new(Params::default(), &[(7, 0, 10 * MS)]).run(|w| w.to_vec());
        assert_eq!(s.done, [(7, 0, 10 * MS)]);
        assert_eq!(s.switches, 0);
        assert!(
            s.runs.iter().all(|r| r.2 <= MS),
            "runs in slices: {:?}",
            s.runs
        );
    }

    #[test]
    fn two_busy_contexts_alternate_slice_by_slice_and_pay_each_switch() {
        let p = Params::default();
        let s = Sim::new(p, &[(1, 0, 10 * MS), (2, 0, 10 * MS)]).run(|w| w.to_vec());
        // Slices alternate 1, 2, 1, 2, ... each one quantum.
        let order: Vec<u64> = s.runs.iter().map(|r| r.0).collect();
        assert!(order.windows(2).all(|w| w[0] != w[1]), "{order:?}");
        assert!(s.runs.iter().all(|r| r.2 == MS));
        // Each kernel spans the other's slices: an event pair around it measures about twice
        // its length, as on a card.
        let end = |c| s.done.iter().find(|d| d.0 == c).unwrap().2;
        assert_eq!(s.switches, 19);
        assert_eq!(end(2), 20 * MS + 19 * 50 * US);
        assert_eq!(end(1), end(2) - MS - 50 * US);
    }

    #[test]
    fn round_robin_holds_against_a_lock_that_always_favours_one_context() {
        // Three contexts with plenty of work; the lock always goes to the lowest-numbered
        // allowed worker first, which would starve 3 without the hand-off.
        let k: Vec<_> = [1, 2, 3].iter().map(|&c| (c, 0, 30 * MS)).collect();
        let s = Sim::new(Params::default(), &k).run(|w| w.to_vec());
        let horizon = 30 * MS;
        let busy: Vec<u64> = [1, 2, 3].iter().map(|&c| s.busy_of(c, horizon)).collect();
        let (lo, hi) = (*busy.iter().min().unwrap(), *busy.iter().max().unwrap());
        assert!(hi - lo <= MS, "unequal slices: {busy:?}");
        let rev = Sim::new(Params::default(), &k).run(|w| w.iter().rev().copied().collect());
        let busy: Vec<u64> = [1, 2, 3].iter().map(|&c| rev.busy_of(c, horizon)).collect();
        let (lo, hi) = (*busy.iter().min().unwrap(), *busy.iter().max().unwrap());
        assert!(hi - lo <= MS, "unequal slices: {busy:?}");
    }

    #[test]
    fn a_context_that_gets_work_runs_within_one_slice() {
        // 1 runs a long kernel alone; 2's short kernel arrives at 3.5 ms.
        let s = Sim::new(
            Params::default(),
            &[(1, 0, 50 * MS), (2, 3 * MS + 500 * US, 2 * MS)],
        )
        .run(|w| w.to_vec());
        let first_of_2 = s.runs.iter().find(|r| r.0 == 2).unwrap().1;
        assert!(
            first_of_2 <= 3 * MS + 500 * US + MS + 50 * US,
            "2 waited until {first_of_2}"
        );
        // And it is done after its 2 ms plus at most one slice of 1 and the switches.
        let end2 = s.done.iter().find(|d| d.0 == 2).unwrap().2;
        assert!(end2 - (3 * MS + 500 * US) <= 2 * MS + 2 * MS + 3 * 50 * US);
    }

    #[test]
    fn a_context_with_no_work_left_is_not_waited_for() {
        // 2's only kernel ends after its slice; then 1 keeps the engine, with no more switches.
        let s = Sim::new(Params::default(), &[(1, 0, 10 * MS), (2, 0, MS)]).run(|w| w.to_vec());
        let end1 = s.done.iter().find(|d| d.0 == 1).unwrap().2;
        assert_eq!(
            end1,
            11 * MS + 100 * US,
            "to 2 and back, nothing after 2 ends"
        );
        assert_eq!(s.switches, 2);
    }

    #[test]
    fn settings_parse_as_documented() {
        assert_eq!(Params::parse(""), Ok(Some(Params::default())));
        assert_eq!(Params::parse("off"), Ok(None));
        assert_eq!(Params::parse("on"), Ok(Some(Params::default())));
        assert_eq!(
            Params::parse("2ms,30us"),
            Ok(Some(Params {
                quantum_ns: 2 * MS,
                switch_ns: 30 * US
            }))
        );
        assert_eq!(
            Params::parse("500us").unwrap().unwrap().switch_ns,
            Params::default().switch_ns
        );
        for bad in ["1", "0ms", "-1ms", "1ms,2ms,3ms", "fast"] {
            assert!(Params::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_next_context_is_the_following_one_in_order_wrapping_around() {
        assert_eq!(next_after(&[1, 2, 3], 2), Some(3));
        assert_eq!(next_after(&[1, 2, 3], 3), Some(1));
        assert_eq!(next_after(&[2], 2), None);
        assert_eq!(next_after(&[], 2), None);
        assert_eq!(next_after(&[5, 9], 7), Some(9));
    }
}
