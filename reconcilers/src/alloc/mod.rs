//! Service IP and node port range arithmetic.
//!
//! Pure code: no Kubernetes types and no I/O, so it can be tested exhaustively and reused by the
//! ClusterIP repair loop (both the IPAddress mode and the audit mode) and by the default
//! ServiceCIDR loop.

mod port_range;
mod range;

pub use port_range::{PORT_RANGE_HINT, PortRange, PortRangeError};
pub use range::{IpFamily, ServiceRange, parse_ip_sloppy};
