//! What the tests and benches of every crate share: one `eventually`, a fake `/readyz`, the
//! binaries run without the developer's environment. It depends on no product crate, so
//! `reconcilers`, `controllers`, the simulator and `e2e` all take it as a dev-dependency.

mod eventually;
pub mod process;
pub mod readyz;

pub use eventually::{Outcome, TimedOut, eventually};
