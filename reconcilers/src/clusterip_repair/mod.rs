//! Loop: ClusterIP repair.

pub mod decide;
pub mod model;
