//! The `kubernetes` Service's endpoints: who the apiservers are, and the Endpoints and
//! EndpointSlices that list them.

pub mod desired;
pub mod members;
