//! Runtime of bootstrap-controller: configuration, the runner that drives the loops, the admin
//! server, metrics, leader election and the binary's subcommands.

pub mod config;
pub mod metrics;
pub mod runner;
