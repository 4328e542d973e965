//! The retry policy of every loop and of the runtime: jittered exponential backoff without a
//! limit on attempts (the API or etcd being away for a while is no reason to give up).

use std::time::Duration;

/// Backoff from `min` doubling up to `max` (`min` is capped at `max`), with jitter, for ever.
pub fn backoff(min: Duration, max: Duration) -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(min.min(max))
        .with_max_delay(max)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
}
