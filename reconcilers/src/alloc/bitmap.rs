//! An in-memory allocation map for one range, rebuilt from the Services on every audit pass.

use std::collections::HashSet;
use std::net::IpAddr;

use fixedbitset::FixedBitSet;

use super::range::ServiceRange;

/// Ranges up to this many usable addresses get a dense bitmap (2 MiB at most); larger ones (big
/// IPv6 ranges) track their few allocated offsets in a set, so a `/64` costs nothing up front.
const DENSE_LIMIT: u128 = 1 << 24;

/// Why an address could not be marked allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("address is not within the range")]
    NotInRange,
    #[error("address is already allocated")]
    Allocated,
}

#[derive(Clone, Debug)]
enum Used {
    Dense(FixedBitSet),
    Sparse(HashSet<u128>),
}

/// Which Service addresses of one range are taken. Bit `n` is the address at offset `n + 1`
/// from the network address (the network address itself is never allocatable).
#[derive(Clone, Debug)]
pub struct RangeAllocator {
    range: ServiceRange,
    used: Used,
    count: u128,
}

impl RangeAllocator {
    pub fn new(range: ServiceRange) -> Self {
        let usable = range.usable_size();
        let used = match usize::try_from(usable) {
            Ok(bits) if usable <= DENSE_LIMIT => Used::Dense(FixedBitSet::with_capacity(bits)),
            _ => Used::Sparse(HashSet::new()),
        };
        Self {
            range,
            used,
            count: 0,
        }
    }

    pub fn range(&self) -> &ServiceRange {
        &self.range
    }

    /// Number of allocated addresses.
    pub fn allocated(&self) -> u128 {
        self.count
    }

    /// Free addresses left.
    pub fn free(&self) -> u128 {
        self.range.usable_size() - self.count
    }

    fn index_of(&self, ip: IpAddr) -> Result<u128, AllocError> {
        if !self.range.holds_service_ip(ip) {
            return Err(AllocError::NotInRange);
        }
        self.range
            .offset_of(ip)
            .map(|offset| offset - 1)
            .ok_or(AllocError::NotInRange)
    }

    /// Marks `ip` allocated; fails if it is outside the range or already taken.
    pub fn allocate(&mut self, ip: IpAddr) -> Result<(), AllocError> {
        let index = self.index_of(ip)?;
        let newly = match &mut self.used {
            Used::Dense(bits) => {
                let bit = usize::try_from(index).map_err(|_| AllocError::NotInRange)?;
                !bits.put(bit)
            }
            Used::Sparse(set) => set.insert(index),
        };
        if !newly {
            return Err(AllocError::Allocated);
        }
        self.count += 1;
        Ok(())
    }

    pub fn is_allocated(&self, ip: IpAddr) -> bool {
        let Ok(index) = self.index_of(ip) else {
            return false;
        };
        match &self.used {
            Used::Dense(bits) => usize::try_from(index).is_ok_and(|bit| bits.contains(bit)),
            Used::Sparse(set) => set.contains(&index),
        }
    }

    /// Frees `ip`; returns whether it was allocated.
    pub fn release(&mut self, ip: IpAddr) -> bool {
        let Ok(index) = self.index_of(ip) else {
            return false;
        };
        let was = match &mut self.used {
            Used::Dense(bits) => match usize::try_from(index) {
                Ok(bit) if bits.contains(bit) => {
                    bits.set(bit, false);
                    true
                }
                _ => false,
            },
            Used::Sparse(set) => set.remove(&index),
        };
        if was {
            self.count -= 1;
        }
        was
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn allocator(cidr: &str) -> RangeAllocator {
        RangeAllocator::new(ServiceRange::new(cidr.parse().unwrap()))
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn allocates_each_usable_address_once() {
        let mut alloc = allocator("10.0.0.0/29");
        assert_eq!(alloc.free(), 6);
        for last in 1..=6 {
            alloc.allocate(ip(&format!("10.0.0.{last}"))).unwrap();
        }
        assert_eq!(alloc.free(), 0);
        assert_eq!(alloc.allocate(ip("10.0.0.3")), Err(AllocError::Allocated));
        assert_eq!(alloc.allocate(ip("10.0.0.0")), Err(AllocError::NotInRange));
        assert_eq!(alloc.allocate(ip("10.0.0.7")), Err(AllocError::NotInRange));
        assert_eq!(alloc.allocate(ip("10.0.0.8")), Err(AllocError::NotInRange));
        assert_eq!(alloc.allocate(ip("fd00::1")), Err(AllocError::NotInRange));
        assert!(alloc.release(ip("10.0.0.3")));
        assert!(!alloc.release(ip("10.0.0.3")));
        assert!(!alloc.is_allocated(ip("10.0.0.3")));
        assert!(alloc.is_allocated(ip("10.0.0.4")));
        assert_eq!(alloc.allocated(), 5);
    }

    #[test]
    fn huge_ipv6_ranges_are_sparse_and_accept_any_address() {
        let mut alloc = allocator("fd00::/64");
        alloc.allocate(ip("fd00::ffff:ffff:ffff:fffe")).unwrap();
        alloc.allocate(ip("fd00::1")).unwrap();
        assert_eq!(
            alloc.allocate(ip("fd00::1")),
            Err(AllocError::Allocated),
            "a duplicate is found in a sparse range too"
        );
        assert_eq!(alloc.allocated(), 2);
        assert!(alloc.is_allocated(ip("fd00::ffff:ffff:ffff:fffe")));
        assert!(alloc.release(ip("fd00::1")));
    }

    #[test]
    fn large_ipv4_range_is_dense() {
        let mut alloc = allocator("10.96.0.0/12");
        assert!(matches!(alloc.used, Used::Dense(_)));
        alloc.allocate(ip("10.111.255.254")).unwrap();
        assert_eq!(
            alloc.allocate(ip("10.111.255.255")),
            Err(AllocError::NotInRange)
        );
    }
}
