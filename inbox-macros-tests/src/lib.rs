//! Nothing to use: this crate holds the UI tests of `inbox-macros` (see `tests/`), kept
//! apart so that the published `inbox-macros` has no dev-dependency on `inbox-core`.
