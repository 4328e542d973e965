//! Waiting for a condition: the one polling loop of the test suites.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How often a condition is polled: often enough that a test waits little past the moment the
/// condition holds, seldom enough that polling a simulator or a real API costs little.
const STEP: Duration = Duration::from_millis(20);

/// What one poll says: not yet, here is the value, or failed this time (kept for the message).
pub trait Outcome {
    type Value;
    fn into_poll(self) -> Result<Option<Self::Value>, String>;
}

impl Outcome for bool {
    type Value = ();
    fn into_poll(self) -> Result<Option<()>, String> {
        Ok(self.then_some(()))
    }
}

impl<T> Outcome for Option<T> {
    type Value = T;
    fn into_poll(self) -> Result<Option<T>, String> {
        Ok(self)
    }
}

impl<T, E: fmt::Display> Outcome for Result<Option<T>, E> {
    type Value = T;
    fn into_poll(self) -> Result<Option<T>, String> {
        // `{:#}` keeps anyhow's chain of causes; other errors ignore the flag.
        self.map_err(|err| format!("{err:#}"))
    }
}

/// A condition that did not hold in time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOut {
    pub what: String,
    pub waited: Duration,
    /// The last failed poll, if the last polls failed rather than said "not yet".
    pub last_error: Option<String>,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}",
            self.waited, self.what
        )?;
        if let Some(err) = &self.last_error {
            write!(f, "; last error: {err}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TimedOut {}

/// Polls `check` until it gives a value (`true`, `Some`, `Ok(Some)`), or fails once `timeout` has
/// passed. A poll that fails (`Err`) is retried; its error is kept for the message.
pub async fn eventually<O, F, Fut>(
    what: &str,
    timeout: Duration,
    mut check: F,
) -> Result<O::Value, TimedOut>
where
    O: Outcome,
    F: FnMut() -> Fut,
    Fut: Future<Output = O>,
{
    let started = Instant::now();
    loop {
        let last_error = match check().await.into_poll() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(err) => Some(err),
        };
        if started.elapsed() >= timeout {
            return Err(TimedOut {
                what: what.to_owned(),
                waited: started.elapsed(),
                last_error,
            });
        }
        tokio::time::sleep(STEP).await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[tokio::test]
    async fn a_condition_that_holds_gives_its_value() {
        let polls = Cell::new(0);
        let value = eventually("the third poll", Duration::from_secs(5), || {
            polls.set(polls.get() + 1);
            std::future::ready((polls.get() == 3).then_some(polls.get()))
        })
        .await
        .unwrap();
        assert_eq!(value, 3);
    }

    #[tokio::test]
    async fn a_condition_that_never_holds_times_out_with_the_last_error() {
        let err = eventually("never", Duration::from_millis(60), || {
            std::future::ready(Err::<Option<()>, _>("refused"))
        })
        .await
        .unwrap_err();
        assert_eq!(err.what, "never");
        assert!(err.waited >= Duration::from_millis(60));
        assert_eq!(err.last_error.as_deref(), Some("refused"));
        assert!(err.to_string().contains("last error: refused"), "{err}");
        let err = eventually("false", Duration::from_millis(30), || {
            std::future::ready(false)
        })
        .await
        .unwrap_err();
        assert_eq!(err.last_error, None);
    }
}
