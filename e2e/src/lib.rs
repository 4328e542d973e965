//! Support for the end-to-end tests in `tests/` and the benches in `benches/`.

pub mod layout;
