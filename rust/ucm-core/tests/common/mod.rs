//! Helpers shared by the integration tests (`mod common;` in each test
//! file). Every test file is its own crate and uses only some of them.

#![allow(dead_code)]

pub mod remote;
pub mod server;
