//! The memory ledger: bytes held per allocation and per connection.
//!
//! Pure data, no I/O: the arbiter keeps one [`Ledger`] behind a mutex, so every operation
//! (check-and-add included) is one critical section and therefore atomic across all processes
//! of an allocation. Connections are tracked individually so that a process that dies (its
//! socket closes) gives back exactly what it held.
//!
//! A closed connection's bytes may stay counted a while, *draining* ([`Ledger::begin_drain`]):
//! the card frees a process's memory when the driver tears the process down, after its socket
//! closed, and until then a sibling granted those bytes would take the allocation past its
//! limit on the card. The arbiter detaches the connection once the card let go.
//!
//! A connection whose reservation did not fit and that waits for room (the arbiter presses its
//! siblings for their unused credit meanwhile) is *waiting* ([`Ledger::begin_wait`]): while any
//! connection of an account waits, [`Ledger::reserve_credit`] gives no credit, since the room it
//! would come from is what the waiter needs; and a connection that is not waiting gets no room a
//! waiter could take now (it waits too): a process that gave its bytes back because a sibling
//! waited does not take them back first with its next reservation.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};

use tessera_protocol::size::human;

/// Internal key of an allocation in the ledger (not its public id).
pub type AccountKey = u64;
/// Arbiter-wide connection number.
pub type ConnId = u64;

/// Errors of ledger operations. The first three are arbiter bugs or races with deletion; the
/// others are a tenant's lies about its memory, refused with nothing changed (the caller
/// closes that connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The account does not exist (never opened, or closed and drained).
    #[error("no ledger account {0}")]
    UnknownAccount(AccountKey),
    /// The account was closed (allocation deleted): it takes no new connections.
    #[error("ledger account {0} is closed")]
    Closed(AccountKey),
    /// The connection is not attached to the account.
    #[error("connection {conn} is not attached to account {key}")]
    UnknownConnection {
        /// Account.
        key: AccountKey,
        /// Connection.
        conn: ConnId,
    },
    /// A release of more than the connection holds.
    #[error("released {} but held only {}", human(*.asked), human(*.held))]
    OverRelease {
        /// Bytes the connection holds.
        held: u64,
        /// Bytes it asked to release.
        asked: u64,
    },
    /// A redeclaration below what the connection is already known to hold.
    #[error("redeclared {} but already holds {}", human(*.asked), human(*.held))]
    RedeclareBelow {
        /// Bytes the connection holds.
        held: u64,
        /// Bytes declared.
        asked: u64,
    },
    /// A redeclaration above the whole allocation's limit: no process of it could hold that.
    #[error(
        "redeclared {}, above the allocation's limit of {}",
        human(*.asked),
        human(*.limit)
    )]
    RedeclareAboveLimit {
        /// The account's limit.
        limit: u64,
        /// Bytes declared.
        asked: u64,
    },
    /// A count would leave the range of `u64` (only lies get there: no GPU holds 2^64 bytes).
    #[error("byte count overflow in account {0}")]
    Overflow(AccountKey),
}

/// Outcome of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// Granted; allocation-wide bytes in use after it.
    Granted {
        /// Bytes in use after the reservation.
        in_use: u64,
    },
    /// Refused; nothing changed.
    Denied {
        /// The account's limit.
        limit: u64,
        /// Bytes in use.
        in_use: u64,
    },
}

/// Outcome of a reservation with credit ([`Ledger::reserve_credit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credit {
    /// Granted: `bytes` reserved in all (the request and the credit given).
    Granted {
        /// Bytes reserved for the connection by this call.
        bytes: u64,
        /// Allocation-wide bytes in use after it.
        in_use: u64,
    },
    /// Refused; nothing changed.
    Denied {
        /// The account's limit.
        limit: u64,
        /// Bytes in use.
        in_use: u64,
    },
}

/// Outcome of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Bytes subtracted.
    pub freed: u64,
    /// Allocation-wide bytes in use after it.
    pub in_use: u64,
}

/// What the admin API reports about one account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Limit, bytes.
    pub limit: u64,
    /// Bytes in use across all connections.
    pub in_use: u64,
    /// Attached connections.
    pub connections: u32,
    /// Closed (deleted) but still draining.
    pub closed: bool,
}

#[derive(Debug)]
struct Account {
    limit: u64,
    in_use: u64,
    closed: bool,
    /// Bytes held per connection. Few entries (one per process), so a small map is fine.
    conns: HashMap<ConnId, u64>,
    /// Bytes the card holds for a connection's process beyond what its connections reserved
    /// (see [`Ledger::set_excess`]), counted in `in_use`.
    excess: HashMap<ConnId, u64>,
    /// The most each connection held at once since [`Ledger::take_peak`] last asked (absent:
    /// what it holds now). Releases never lower it.
    peak: HashMap<ConnId, u64>,
    /// Connections that closed and whose bytes stay counted until the card freed them (see
    /// [`Ledger::begin_drain`]); still in `conns` until detached.
    draining: HashSet<ConnId>,
    /// Connections with a reservation waiting for room, and the bytes each waits for (see
    /// [`Ledger::begin_wait`]).
    waiting: BTreeMap<ConnId, u64>,
}

impl Account {
    /// Whether `conn`, not itself waiting, must leave `bytes` of room to a waiting sibling: a
    /// waiter's request fits in the room now and would not once `conn` had `bytes` of it. (A
    /// waiter whose request does not fit blocks nobody: it may never fit.)
    fn yields(&self, conn: ConnId, bytes: u64) -> bool {
        if self.waiting.contains_key(&conn) {
            return false;
        }
        let room = self.limit.saturating_sub(self.in_use);
        let left = room.saturating_sub(bytes);
        self.waiting
            .iter()
            .any(|(c, need)| *c != conn && *need <= room && *need > left)
    }

    /// Takes `bytes` a connection held (its excess included) off the total. The total is the
    /// sum of the connections' (and their excess), so this cannot fail unless the ledger is
    /// broken; then zero is the least wrong total, and the caller reports the overflow.
    fn take_off(&mut self, bytes: u64) -> Option<u64> {
        let in_use = self.in_use.checked_sub(bytes);
        self.in_use = in_use.unwrap_or(0);
        in_use
    }

    /// Adds `bytes` to `conn` (attached) and to the total, both or neither.
    fn add(&mut self, key: AccountKey, conn: ConnId, bytes: u64) -> Result<(), LedgerError> {
        let held = self
            .conns
            .get_mut(&conn)
            .ok_or(LedgerError::UnknownConnection { key, conn })?;
        let (Some(total), Some(mine)) = (self.in_use.checked_add(bytes), held.checked_add(bytes))
        else {
            return Err(LedgerError::Overflow(key));
        };
        self.in_use = total;
        *held = mine;
        let peak = self.peak.entry(conn).or_insert(mine);
        *peak = (*peak).max(mine);
        Ok(())
    }
}

/// Bytes held per allocation and connection.
#[derive(Debug, Default)]
pub struct Ledger {
    accounts: HashMap<AccountKey, Account>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens an account with `limit` bytes. Reopening an existing key replaces its limit.
    pub fn open(&mut self, key: AccountKey, limit: u64) {
        self.accounts
            .entry(key)
            .and_modify(|a| {
                a.limit = limit;
                a.closed = false;
            })
            .or_insert(Account {
                limit,
                in_use: 0,
                closed: false,
                conns: HashMap::new(),
                excess: HashMap::new(),
                peak: HashMap::new(),
                draining: HashSet::new(),
                waiting: BTreeMap::new(),
            });
    }

    /// Closes an account: further reservations are denied and no connection may attach, but
    /// releases are still served. The account disappears once its last connection detaches.
    /// Returns true when it disappeared now (no connection was attached).
    pub fn close(&mut self, key: AccountKey) -> Result<bool, LedgerError> {
        let acct = self
            .accounts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAccount(key))?;
        acct.closed = true;
        if acct.conns.is_empty() {
            self.accounts.remove(&key);
            return Ok(true);
        }
        Ok(false)
    }

    /// Attaches a new connection holding nothing.
    pub fn attach(&mut self, key: AccountKey, conn: ConnId) -> Result<(), LedgerError> {
        let acct = self
            .accounts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAccount(key))?;
        if acct.closed {
            return Err(LedgerError::Closed(key));
        }
        acct.conns.entry(conn).or_insert(0);
        Ok(())
    }

    fn account(&mut self, key: AccountKey, conn: ConnId) -> Result<&mut Account, LedgerError> {
        let acct = self
            .accounts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAccount(key))?;
        if !acct.conns.contains_key(&conn) {
            return Err(LedgerError::UnknownConnection { key, conn });
        }
        Ok(acct)
    }

    /// Reserves `bytes` for `conn` if the whole account stays within its limit: check and add
    /// happen together, so racing connections can never pass the limit. A closed account
    /// denies everything.
    pub fn reserve(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        bytes: u64,
    ) -> Result<Reservation, LedgerError> {
        let acct = self.account(key, conn)?;
        let fits = acct
            .in_use
            .checked_add(bytes)
            .is_some_and(|total| total <= acct.limit);
        if acct.closed || !fits || acct.yields(conn, bytes) {
            return Ok(Reservation::Denied {
                limit: acct.limit,
                in_use: acct.in_use,
            });
        }
        acct.add(key, conn, bytes)?;
        Ok(Reservation::Granted {
            in_use: acct.in_use,
        })
    }

    /// Reserves `bytes` for `conn` like [`Ledger::reserve`], plus up to `extra` bytes of
    /// credit (memory the process may allocate later without asking). The credit is taken
    /// only from room nobody else needs: at most half of what stays free after `bytes`, so
    /// one process's credit never fills the allocation, and none while a connection of the
    /// account waits for room (see [`Ledger::begin_wait`]). Returns the bytes reserved in all.
    pub fn reserve_credit(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        bytes: u64,
        extra: u64,
    ) -> Result<Credit, LedgerError> {
        let acct = self.account(key, conn)?;
        let after = acct
            .in_use
            .checked_add(bytes)
            .filter(|total| *total <= acct.limit);
        let (Some(after), false) = (after, acct.closed || acct.yields(conn, bytes)) else {
            return Ok(Credit::Denied {
                limit: acct.limit,
                in_use: acct.in_use,
            });
        };
        // `after <= limit` above, so neither can fail; checked all the same.
        let room = acct
            .limit
            .checked_sub(after)
            .ok_or(LedgerError::Overflow(key))?;
        // A waiter needs the room: credit given now would sit unused in a process its pressing
        // may already have passed, and the waiter be refused beside it.
        let extra = if acct.waiting.is_empty() {
            extra.min(room / 2)
        } else {
            0
        };
        let granted = bytes.checked_add(extra).ok_or(LedgerError::Overflow(key))?;
        acct.add(key, conn, granted)?;
        Ok(Credit::Granted {
            bytes: granted,
            in_use: acct.in_use,
        })
    }

    /// The other connections of account `key` that hold any bytes (whose unused credit could
    /// be pressed back), in no particular order.
    pub fn others_holding(&self, key: AccountKey, conn: ConnId) -> Vec<ConnId> {
        self.accounts
            .get(&key)
            .map(|a| {
                a.conns
                    .iter()
                    .filter(|(c, held)| **c != conn && **held > 0 && !a.draining.contains(*c))
                    .map(|(c, _)| *c)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Releases `bytes` held by `conn`. More than it holds is refused with nothing changed
    /// ([`LedgerError::OverRelease`]): the tenant lies or lost count, and its connection is
    /// closed rather than trusted with another process's bytes.
    pub fn release(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        bytes: u64,
    ) -> Result<Released, LedgerError> {
        let acct = self.account(key, conn)?;
        let held = acct.conns[&conn];
        let left = held
            .checked_sub(bytes)
            .ok_or(LedgerError::OverRelease { held, asked: bytes })?;
        let in_use = acct
            .in_use
            .checked_sub(bytes)
            .ok_or(LedgerError::Overflow(key))?;
        acct.conns.insert(conn, left);
        acct.in_use = in_use;
        Ok(Released {
            freed: bytes,
            in_use,
        })
    }

    /// Sets what `conn` holds to `bytes` (after an arbiter restart the process declares its
    /// live memory). Accepted even when the allocation as a whole passes its limit (the memory
    /// exists; a process that reserved after the restart but before an older one redeclared
    /// can cause that), but never below what `conn` already holds, never above the limit for
    /// one connection (no process of the allocation could have held more), and never past
    /// `u64`. Idempotent.
    pub fn redeclare(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        bytes: u64,
    ) -> Result<u64, LedgerError> {
        let acct = self.account(key, conn)?;
        let held = acct.conns[&conn];
        if bytes < held {
            return Err(LedgerError::RedeclareBelow { held, asked: bytes });
        }
        if bytes > acct.limit {
            return Err(LedgerError::RedeclareAboveLimit {
                limit: acct.limit,
                asked: bytes,
            });
        }
        acct.add(key, conn, bytes - held)?;
        Ok(acct.in_use)
    }
}

/// A connection's end (detach, drain), waiting reservations, what the card holds beyond the
/// reservations, and readings.
impl Ledger {
    /// Detaches `conn` (its process exited or its socket closed) and frees all it held.
    /// Returns the bytes freed. Drops a closed account once its last connection is gone.
    pub fn detach(&mut self, key: AccountKey, conn: ConnId) -> Result<u64, LedgerError> {
        let acct = self
            .accounts
            .get_mut(&key)
            .ok_or(LedgerError::UnknownAccount(key))?;
        let held = acct
            .conns
            .remove(&conn)
            .ok_or(LedgerError::UnknownConnection { key, conn })?;
        let excess = acct.excess.remove(&conn).unwrap_or(0);
        acct.peak.remove(&conn);
        acct.draining.remove(&conn);
        acct.waiting.remove(&conn);
        let in_use = acct.take_off(held.saturating_add(excess));
        if acct.closed && acct.conns.is_empty() {
            self.accounts.remove(&key);
        }
        in_use.map(|_| held).ok_or(LedgerError::Overflow(key))
    }

    /// Marks `conn` as draining: its socket closed, but its process's memory may still be on
    /// the card, so what it holds (its excess included) stays counted until [`Ledger::detach`].
    /// A draining connection is not pressed for credit (nobody is there to answer) and its bytes
    /// show in [`Ledger::draining`], which a reservation that would fit without them waits for.
    /// Returns the bytes it holds.
    pub fn begin_drain(&mut self, key: AccountKey, conn: ConnId) -> Result<u64, LedgerError> {
        let acct = self.account(key, conn)?;
        acct.draining.insert(conn);
        Ok(acct.conns[&conn].saturating_add(acct.excess.get(&conn).copied().unwrap_or(0)))
    }

    /// Frees what draining connection `conn` holds (its excess included) and keeps it
    /// attached, draining, holding nothing: the card let its process's memory go before the
    /// connection's own thread came to [`Ledger::detach`] it (which then frees nothing).
    /// Returns the bytes freed; 0 for a connection that is not draining.
    pub fn release_drained(&mut self, key: AccountKey, conn: ConnId) -> Result<u64, LedgerError> {
        let acct = self.account(key, conn)?;
        if !acct.draining.contains(&conn) {
            return Ok(0);
        }
        let held = acct.conns.insert(conn, 0).unwrap_or(0);
        let excess = acct.excess.remove(&conn).unwrap_or(0);
        let bytes = held.saturating_add(excess);
        acct.take_off(bytes)
            .map(|_| bytes)
            .ok_or(LedgerError::Overflow(key))
    }

    /// Marks `conn` as waiting for room for `need` bytes: its reservation did not fit, and it
    /// presses its siblings for their unused credit and waits for their frees. Until
    /// [`Ledger::end_wait`] (or its detach), no connection of the account is given credit, and
    /// one that is not waiting is not given room this one could take (see the module's notes).
    /// Idempotent (the last `need` counts).
    pub fn begin_wait(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        need: u64,
    ) -> Result<(), LedgerError> {
        self.account(key, conn)?.waiting.insert(conn, need);
        Ok(())
    }

    /// `conn` waits no more (granted, or refused). A connection or account that is gone is
    /// not an error: its wait ended with it.
    pub fn end_wait(&mut self, key: AccountKey, conn: ConnId) {
        if let Some(a) = self.accounts.get_mut(&key) {
            a.waiting.remove(&conn);
        }
    }

    /// Whether a connection of account `key` other than `conn` waits for room.
    pub fn others_waiting(&self, key: AccountKey, conn: ConnId) -> bool {
        self.accounts
            .get(&key)
            .is_some_and(|a| a.waiting.keys().any(|c| *c != conn))
    }

    /// Bytes of account `key` held by draining connections (0 for an unknown account).
    pub fn draining(&self, key: AccountKey) -> u64 {
        self.accounts.get(&key).map_or(0, |a| {
            a.draining
                .iter()
                .map(|c| {
                    let held = a.conns.get(c).copied().unwrap_or(0);
                    held.saturating_add(a.excess.get(c).copied().unwrap_or(0))
                })
                .fold(0u64, u64::saturating_add)
        })
    }

    /// Bytes `conn` holds in account `key` (its excess included) unless it drains already:
    /// 0 for a draining or unknown connection. (The bytes of a connection whose process the
    /// caller knows has exited, before its thread marks it draining.)
    pub fn held_undrained(&self, key: AccountKey, conn: ConnId) -> u64 {
        self.accounts.get(&key).map_or(0, |a| {
            if a.draining.contains(&conn) {
                return 0;
            }
            let held = a.conns.get(&conn).copied().unwrap_or(0);
            held.saturating_add(a.excess.get(&conn).copied().unwrap_or(0))
        })
    }

    /// Sets what the card holds for `conn`'s process beyond what its connections reserved
    /// (NVML's figure for the process less their bytes: a context bigger than the interposer's
    /// estimate, the driver's rounding), so that the account's use is what the card holds for
    /// it and a later reservation that would not fit on the card is refused. Replaces the
    /// connection's previous excess; 0 clears it; it goes with the connection. Accepted even
    /// when the account then passes its limit (the memory exists). Returns the account's use.
    pub fn set_excess(
        &mut self,
        key: AccountKey,
        conn: ConnId,
        bytes: u64,
    ) -> Result<u64, LedgerError> {
        let acct = self.account(key, conn)?;
        let old = acct.excess.get(&conn).copied().unwrap_or(0);
        let in_use = acct
            .in_use
            .checked_sub(old)
            .and_then(|u| u.checked_add(bytes))
            .ok_or(LedgerError::Overflow(key))?;
        acct.in_use = in_use;
        if bytes == 0 {
            acct.excess.remove(&conn);
        } else {
            acct.excess.insert(conn, bytes);
        }
        Ok(in_use)
    }

    /// Limit and use of an account.
    pub fn usage(&self, key: AccountKey) -> Option<Usage> {
        self.accounts.get(&key).map(|a| Usage {
            limit: a.limit,
            in_use: a.in_use,
            connections: a.conns.len() as u32,
            closed: a.closed,
        })
    }

    /// Bytes `conn` holds in account `key`.
    pub fn held(&self, key: AccountKey, conn: ConnId) -> Option<u64> {
        self.accounts
            .get(&key)
            .and_then(|a| a.conns.get(&conn).copied())
    }

    /// The most `conn` held at once since the last call (or since it attached), and from now
    /// on the peak starts again at what it holds. What the card showed at any instant in that
    /// time is within this figure for an honest process (it reserves before it allocates and
    /// releases after it frees), however late the caller reads the ledger after the card.
    pub fn take_peak(&mut self, key: AccountKey, conn: ConnId) -> Option<u64> {
        let acct = self.accounts.get_mut(&key)?;
        let held = acct.conns.get(&conn).copied()?;
        let peak = acct.peak.insert(conn, held).unwrap_or(held);
        Some(peak.max(held))
    }
}

#[cfg(test)]
mod properties;

#[cfg(test)]
mod tests;
