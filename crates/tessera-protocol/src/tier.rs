//! The service tier of an allocation, set by the operator when it is created (never by the
//! tenant: it is stored with the allocation in the arbiter).

use serde::{Deserialize, Serialize};

/// How an allocation's compute time is scheduled against the others on its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Tier {
    /// Weighted shares, work-conserving: it gets what the latency tenants leave, in proportion
    /// to its share among the best-effort ones.
    #[default]
    BestEffort,
    /// Served first: its share is both its guarantee and its ceiling over a window, and while
    /// it is registered best-effort holders keep little work in flight, so its requests wait
    /// about that much, not a lease.
    Latency,
}

impl Tier {
    /// The name used on the command line, in status and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::BestEffort => "best-effort",
            Tier::Latency => "latency",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tier name that is neither `latency` nor `best-effort`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tier {0:?}: expected latency or best-effort")]
pub struct UnknownTier(pub String);

impl std::str::FromStr for Tier {
    type Err = UnknownTier;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "latency" => Ok(Tier::Latency),
            "best-effort" | "besteffort" | "best_effort" => Ok(Tier::BestEffort),
            other => Err(UnknownTier(other.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_are_refused() {
        for t in [Tier::Latency, Tier::BestEffort] {
            assert_eq!(t.as_str().parse::<Tier>(), Ok(t));
        }
        assert_eq!(Tier::default(), Tier::BestEffort);
        assert!("urgent".parse::<Tier>().is_err());
        assert!("".parse::<Tier>().is_err());
    }
}
