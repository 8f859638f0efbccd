//! Switches that turn single guarantees of the batch path off, for benchmarks that
//! measure what each one costs. Only with the `bench-knobs` feature, which is never
//! for production: a store with a switch off loses the guarantee it names. Without
//! the feature every switch is on and the checks compile to constants.

/// Which guarantees of the batch path a benchmark turns off; every one is on by
/// default. **Benchmarks only**: a store with any switch off no longer makes the
/// guarantee it names (PostgreSQL; the SQLite claim ignores `takeover` and
/// `narrow_claims`). Given to a store with
/// [`StoreBuilder::bench_knobs`](crate::StoreBuilder::bench_knobs), read once when
/// the store is built.
#[cfg(feature = "bench-knobs")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BenchKnobs {
    /// The payload digest (SHA-256) of each delivery; off, every digest is 32 zero
    /// bytes, so a key collision goes unseen.
    pub digest: bool,
    /// The transaction checks around the handlers: the handlers' savepoint, the
    /// transaction token read with the claim and checked before the commit; off, a
    /// swallowed database error commits as a silent rollback.
    pub commit_checks: bool,
    /// The claim's takeover clause (a failed or started claim with the same digest,
    /// due, is taken over); off, the claim is `ON CONFLICT DO NOTHING`.
    pub takeover: bool,
    /// The duplicate lookup of keys the claim did not return; off, they are acked as
    /// duplicates unread (no collision, no retry wait, no phantom conflict).
    pub lookup: bool,
    /// Off by default. On, the claim writes only the claim key, `DO NOTHING`, into a
    /// two-column `inbox_claims` the benchmark put in its own schema in place of the
    /// migrated one (no digest, status, retry or time columns); implies `takeover`
    /// and `lookup` off.
    pub narrow_claims: bool,
}

#[cfg(feature = "bench-knobs")]
impl Default for BenchKnobs {
    fn default() -> Self {
        Self {
            digest: true,
            commit_checks: true,
            takeover: true,
            lookup: true,
            narrow_claims: false,
        }
    }
}

#[cfg(feature = "bench-knobs")]
impl BenchKnobs {
    /// Every guarantee on: what a store without knobs does.
    pub fn full() -> Self {
        Self::default()
    }
}

/// The store's switches as the batch path reads them: constants without the feature.
#[derive(Clone, Copy, Debug, Default)]
pub struct Knobs {
    #[cfg(feature = "bench-knobs")]
    pub(crate) set: Option<BenchKnobs>,
}

#[cfg(feature = "bench-knobs")]
impl Knobs {
    fn get(&self) -> BenchKnobs {
        self.set.unwrap_or_default()
    }

    pub(crate) fn digest(&self) -> bool {
        self.get().digest
    }

    pub(crate) fn commit_checks(&self) -> bool {
        self.get().commit_checks
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL\'s claim statement
    pub(crate) fn takeover(&self) -> bool {
        let k = self.get();
        k.takeover && !k.narrow_claims
    }

    pub(crate) fn lookup(&self) -> bool {
        let k = self.get();
        k.lookup && !k.narrow_claims
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL\'s claim statement
    pub(crate) fn narrow_claims(&self) -> bool {
        self.get().narrow_claims
    }
}

#[cfg(not(feature = "bench-knobs"))]
impl Knobs {
    pub(crate) const fn digest(&self) -> bool {
        true
    }

    pub(crate) const fn commit_checks(&self) -> bool {
        true
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL\'s claim statement
    pub(crate) const fn takeover(&self) -> bool {
        true
    }

    pub(crate) const fn lookup(&self) -> bool {
        true
    }

    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // PostgreSQL\'s claim statement
    pub(crate) const fn narrow_claims(&self) -> bool {
        false
    }
}
