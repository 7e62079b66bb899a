//! Property tests: the ledger against a model of what each connection holds, over random
//! sequences of every operation. The ledger's promises, checked after every step:
//! - no reservation (plain or with credit) takes an account past its limit; one that would is
//!   denied and changes nothing;
//! - the account's use is always what its connections hold plus their excess;
//! - a release of more than a connection holds is refused and changes nothing;
//! - a detach gives back exactly what the connection held; a draining connection's bytes stay
//!   counted until then and are what `draining` reports.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::*;

const KEY: AccountKey = 1;
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Attach(ConnId),
    Reserve(ConnId, u64),
    ReserveCredit(ConnId, u64, u64),
    Release(ConnId, u64),
    SetExcess(ConnId, u64),
    BeginDrain(ConnId),
    Detach(ConnId),
}

fn op() -> impl Strategy<Value = Op> {
    // Few connections and sizes around the limit, so refusals, over-releases and full
    // accounts come up often.
    let conn = 0..4u64;
    let bytes = (0..1200u64).prop_map(|m| m * MIB);
    prop_oneof![
        conn.clone().prop_map(Op::Attach),
        (conn.clone(), bytes.clone()).prop_map(|(c, b)| Op::Reserve(c, b)),
        (conn.clone(), bytes.clone(), bytes.clone())
            .prop_map(|(c, b, e)| Op::ReserveCredit(c, b, e)),
        (conn.clone(), bytes.clone()).prop_map(|(c, b)| Op::Release(c, b)),
        (conn.clone(), (0..200u64).prop_map(|m| m * MIB)).prop_map(|(c, b)| Op::SetExcess(c, b)),
        conn.clone().prop_map(Op::BeginDrain),
        conn.prop_map(Op::Detach),
    ]
}

/// What each attached connection holds and its excess, as the tests expect them.
#[derive(Debug, Default)]
struct Model {
    held: HashMap<ConnId, u64>,
    excess: HashMap<ConnId, u64>,
    draining: HashSet<ConnId>,
}

impl Model {
    fn in_use(&self) -> u64 {
        self.held.values().sum::<u64>() + self.excess.values().sum::<u64>()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_keeps_its_promises(limit_mib in 1..1024u64, ops in prop::collection::vec(op(), 1..60)) {
        let limit = limit_mib * MIB;
        let mut l = Ledger::new();
        l.open(KEY, limit);
        let mut m = Model::default();
        for op in ops {
            let before = l.usage(KEY).unwrap().in_use;
            match op {
                Op::Attach(c) => {
                    l.attach(KEY, c).unwrap();
                    m.held.entry(c).or_insert(0);
                }
                Op::Reserve(c, b) => match l.reserve(KEY, c, b) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(e) => prop_assert!(false, "reserve failed: {e}"),
                    Ok(Reservation::Granted { in_use }) => {
                        prop_assert!(before + b <= limit, "granted past the limit");
                        *m.held.get_mut(&c).unwrap() += b;
                        prop_assert_eq!(in_use, m.in_use());
                    }
                    Ok(Reservation::Denied { .. }) => {
                        prop_assert!(before + b > limit, "denied what fitted");
                        prop_assert_eq!(l.usage(KEY).unwrap().in_use, before);
                    }
                },
                Op::ReserveCredit(c, b, e) => match l.reserve_credit(KEY, c, b, e) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(err) => prop_assert!(false, "reserve_credit failed: {err}"),
                    Ok(Credit::Granted { bytes, in_use }) => {
                        prop_assert!(bytes >= b && bytes - b <= e, "credit outside what was asked");
                        prop_assert!(before + bytes <= limit, "credit past the limit");
                        *m.held.get_mut(&c).unwrap() += bytes;
                        prop_assert_eq!(in_use, m.in_use());
                    }
                    Ok(Credit::Denied { .. }) => {
                        prop_assert!(before + b > limit, "denied what fitted");
                        prop_assert_eq!(l.usage(KEY).unwrap().in_use, before);
                    }
                },
                Op::Release(c, b) => match l.release(KEY, c, b) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(LedgerError::OverRelease { held, asked }) => {
                        prop_assert_eq!(held, m.held[&c]);
                        prop_assert!(asked > held);
                        prop_assert_eq!(l.usage(KEY).unwrap().in_use, before);
                    }
                    Err(e) => prop_assert!(false, "release failed: {e}"),
                    Ok(r) => {
                        *m.held.get_mut(&c).unwrap() -= b;
                        prop_assert_eq!(r.in_use, m.in_use());
                    }
                },
                Op::SetExcess(c, b) => match l.set_excess(KEY, c, b) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(e) => prop_assert!(false, "set_excess failed: {e}"),
                    Ok(in_use) => {
                        if b == 0 {
                            m.excess.remove(&c);
                        } else {
                            m.excess.insert(c, b);
                        }
                        prop_assert_eq!(in_use, m.in_use());
                    }
                },
                Op::BeginDrain(c) => match l.begin_drain(KEY, c) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(e) => prop_assert!(false, "begin_drain failed: {e}"),
                    Ok(bytes) => {
                        prop_assert_eq!(bytes, m.held[&c] + m.excess.get(&c).copied().unwrap_or(0));
                        m.draining.insert(c);
                        prop_assert!(!l.others_holding(KEY, u64::MAX).contains(&c), "a draining connection is pressed");
                    }
                },
                Op::Detach(c) => match l.detach(KEY, c) {
                    Err(LedgerError::UnknownConnection { .. }) => prop_assert!(!m.held.contains_key(&c)),
                    Err(e) => prop_assert!(false, "detach failed: {e}"),
                    Ok(freed) => {
                        prop_assert_eq!(freed, m.held.remove(&c).unwrap());
                        m.excess.remove(&c);
                        m.draining.remove(&c);
                    }
                },
            }
            // After every step: the account's use is its connections' bytes and excess, and the
            // draining figure is the draining connections'.
            prop_assert_eq!(l.usage(KEY).unwrap().in_use, m.in_use());
            let draining: u64 = m
                .draining
                .iter()
                .map(|c| m.held[c] + m.excess.get(c).copied().unwrap_or(0))
                .sum();
            prop_assert_eq!(l.draining(KEY), draining);
            for (c, h) in &m.held {
                prop_assert_eq!(l.held(KEY, *c), Some(*h));
            }
        }
    }
}
