//! Runtime of bootstrap-controller: configuration, the runner that drives the loops, the admin
//! server, metrics, leader election and the binary's subcommands.

pub mod admin;
pub mod build_info;
pub mod cli;
pub mod client;
pub mod config;
pub mod etcd_claims;
pub mod health;
pub mod kubeconfig;
pub mod leader;
pub mod limits;
pub mod log_format;
pub mod metrics;
pub mod process;
pub mod runner;
pub mod shards;
pub mod sidecar;
pub mod tenant_kubeconfig;
pub mod tenants;
#[cfg(test)]
mod test_log;
