//! The derive as users meet it: what compiles (and behaves) and what fails, with
//! rustc's output for each misuse recorded next to it in `ui/fail/*.stderr`.
//!
//! After an intended change to a message, `TRYBUILD=overwrite cargo test -p
//! inbox-macros-tests --test compiletest` rewrites the `.stderr` files; review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
