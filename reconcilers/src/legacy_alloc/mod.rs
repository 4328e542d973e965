//! The legacy allocation bitmaps kube-apiserver keeps in etcd (`RangeAllocation` at
//! `<prefix>/ranges/servicenodeports`, `serviceips`, `secondaryserviceips`), and their repair.
//!
//! `codec` and `repair` are pure; `etcd` is the only part that talks to etcd.

pub mod codec;
pub mod etcd;
pub mod repair;
