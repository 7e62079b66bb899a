//! The scheduler's tunables.

/// Tunables (defaults in [`SchedulerParams::default`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerParams {
    /// Shortest lease, ns.
    pub min_lease_ns: u64,
    /// Longest lease, ns.
    pub max_lease_ns: u64,
    /// First lease of an allocation, ns.
    pub initial_lease_ns: u64,
    /// Longest lease while another allocation waits, ns.
    pub contended_lease_ns: u64,
    /// Time after the deadline before a lease is revoked, ns.
    pub grace_ns: u64,
    /// Longest a lease ended by the scheduler still counts as leased while its holder drains
    /// (the interposer reports after at most 2 s of drain), ns.
    pub revoked_drain_ns: u64,
    /// Depth of a capped allocation's token bucket, ns.
    pub bucket_depth_ns: u64,
    /// A capped allocation is charged at most its cap of every window this long (the bucket
    /// alone lets a full bucket's worth more into a window), ns.
    pub cap_window_ns: u64,
    /// What a cap window holds beyond the cap, ns: the bucket (filled at exactly the cap)
    /// decides the average, and it can only make up for the time a capped tenant waited for
    /// the GPU where the window leaves it room; a window at exactly the cap made each wait
    /// a loss (a tenant capped at 20 got 18.9%, one at 30 got 28.8%, in the pure model).
    pub cap_window_slack_ns: u64,
    /// Window of [`GpuScheduler::gpu_time`](super::GpuScheduler::gpu_time), ns.
    pub window_ns: u64,
    /// An allocation that asks again within this time of its last lease ending still counts
    /// as active (a backlogged tenant is briefly between leases); after a longer pause it
    /// rejoins at the others' virtual time.
    pub idle_after_ns: u64,
    /// After a lease used to its end, the GPU is held this long for its allocation if that
    /// allocation would be next by virtual time: the holder's next request always arrives
    /// just after its release, and without this wait the waiter would win every time
    /// (strict alternation instead of the weighted split).
    pub rerequest_window_ns: u64,
    /// While a latency allocation is in use on the GPU: the predicted kernel time a
    /// best-effort holder may keep in flight (what a latency request waits for at most, beside
    /// the revocation's round trip), ns.
    pub best_effort_inflight_ns: u64,
    /// After a latency lease handed back early (its request done), the GPU stays held for that
    /// allocation this long, charged to it as GPU time: a next request within it is granted
    /// with no best-effort kernel started in between (0: no linger), ns. Granted only while
    /// its cap window has room for it, so lingering never takes it past its share.
    pub latency_linger_ns: u64,
}

impl Default for SchedulerParams {
    fn default() -> Self {
        const MS: u64 = 1_000_000;
        Self {
            min_lease_ns: 10 * MS,
            max_lease_ns: 100 * MS,
            initial_lease_ns: 20 * MS,
            contended_lease_ns: 20 * MS,
            grace_ns: 50 * MS,
            revoked_drain_ns: 2_000 * MS,
            bucket_depth_ns: 40 * MS,
            cap_window_ns: 1_000 * MS,
            cap_window_slack_ns: 5 * MS,
            window_ns: 10_000 * MS,
            idle_after_ns: 50 * MS,
            rerequest_window_ns: 2 * MS,
            best_effort_inflight_ns: MS,
            latency_linger_ns: 0,
        }
    }
}
