//! What the tests and benches of every crate share. It depends on no product crate, so
//! `reconcilers`, `controllers`, the simulator and `e2e` all take it as a dev-dependency.

mod eventually;
pub mod readyz;

pub use eventually::{Outcome, TimedOut, eventually};
