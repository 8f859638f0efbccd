//! `verify_schema`: the claim table's unique index must enforce exactly the claim key,
//! by the one rule every keyed table is checked with ([`check_key`]).

use inbox_core::ClaimKey;

use crate::{Error, Result, SchemaPart, SchemaProblem};

/// One index of the claim table, as the live catalog describes it.
#[derive(Debug)]
pub struct IndexInfo {
    pub name: String,
    pub unique: bool,
    pub partial: bool,
    /// The constraint behind it is deferrable, initially deferred or not (on
    /// PostgreSQL, `NOT indimmediate`; SQLite has no deferrable unique constraints).
    pub deferrable: bool,
    /// Usable by queries and maintained by writes (on PostgreSQL `indisvalid`,
    /// `indisready` and `indislive`; an SQLite index always is).
    pub valid: bool,
    /// Key columns in index order; `None` for an expression.
    pub columns: Vec<Option<String>>,
    /// Per key column, in the same order: the collation under which values that
    /// differ in bytes compare equal (non-deterministic on PostgreSQL, anything but
    /// BINARY on SQLite), or `None`.
    pub loose_collations: Vec<Option<String>>,
}

/// One column of the claim table.
#[derive(Debug)]
pub struct ColumnInfo {
    pub name: String,
    pub not_null: bool,
    /// The column's collation when values that differ in bytes compare equal under
    /// it (the lookup by key compares under it): a non-deterministic one on
    /// PostgreSQL, the declared `COLLATE` other than BINARY on SQLite. An index may
    /// name its own collation, so this is checked apart from the indexes'.
    pub loose_collation: Option<String>,
    /// The declared type, lower-case (`bytea`, `blob`, ...).
    pub type_name: String,
}

/// What the live catalog says about one of the store's tables.
#[derive(Debug)]
pub struct Catalog {
    /// The table's name as the store sees it (schema-qualified on PostgreSQL).
    pub table: String,
    /// Whether the table exists.
    pub exists: bool,
    pub indexes: Vec<IndexInfo>,
    /// (column, not null) for every column of the table.
    pub columns: Vec<ColumnInfo>,
}

/// An index as the schema errors print it (validity, deferrability, partiality,
/// columns with their collations, name).
pub(crate) fn describe(index: &IndexInfo) -> String {
    let cols: Vec<String> = index
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let name = c.as_deref().unwrap_or("<expression>");
            match index.loose_collations.get(i).and_then(Option::as_deref) {
                Some(collation) => format!("{name} collate {collation}"),
                None => name.to_owned(),
            }
        })
        .collect();
    format!(
        "{}{}{}unique ({}) [{}]",
        if index.valid { "" } else { "invalid " },
        if index.deferrable { "deferrable " } else { "" },
        if index.partial { "partial " } else { "" },
        cols.join(", "),
        index.name
    )
}

/// A table's key: the columns its unique index must enforce exactly, and whose
/// schema objects they are (the claim table's, the idempotency table's, the rebuild
/// runs', the outbox's).
#[derive(Clone, Copy)]
pub(crate) struct Key {
    /// Whose table.
    pub part: SchemaPart,
    /// The key's columns.
    pub columns: &'static [&'static str],
    /// Columns the database fills with values of its own that never repeat (the
    /// outbox's `id`): a unique index on one of them refuses no row the key allows.
    pub generated: &'static [&'static str],
}

/// The claim table's key.
const CLAIMS: Key = Key {
    part: SchemaPart::Claims,
    columns: &ClaimKey::COLUMNS,
    generated: &[],
};

impl Key {
    fn list(self) -> String {
        format!("({})", self.columns.join(", "))
    }

    /// Whether the index's plain columns include every key column.
    fn covered_by(self, index: &IndexInfo) -> bool {
        self.columns
            .iter()
            .all(|k| index.columns.iter().any(|c| c.as_deref() == Some(*k)))
    }

    /// Whether the index's plain columns are the key's, in any order: the indexes
    /// `ON CONFLICT (<key>)` takes as its arbiters.
    fn same_columns(self, index: &IndexInfo) -> bool {
        index.columns.len() == self.columns.len() && self.covered_by(index)
    }

    /// Whether the index compares a key column under a loose collation: it would
    /// refuse a key that the lookup, comparing bytes, tells apart from another.
    fn folded_by(self, index: &IndexInfo) -> bool {
        index
            .columns
            .iter()
            .zip(&index.loose_collations)
            .any(|(c, loose)| {
                loose.is_some() && c.as_deref().is_some_and(|c| self.columns.contains(&c))
            })
    }

    /// Whether the index contains a column the database generates (see
    /// [`Key::generated`]).
    fn on_generated(self, index: &IndexInfo) -> bool {
        index
            .columns
            .iter()
            .any(|c| c.as_deref().is_some_and(|c| self.generated.contains(&c)))
    }

    /// Whether the index is exactly the key: unique, not partial, no expression, the
    /// same column set (not a superset), keys equal only when their bytes are.
    fn is_exactly(self, index: &IndexInfo) -> bool {
        index.unique && !index.partial && !self.folded_by(index) && self.same_columns(index)
    }
}

/// Refuses a claim table whose unique indexes do not enforce exactly the claim key.
pub(crate) fn check(catalog: &Catalog) -> Result<()> {
    check_key(catalog, CLAIMS)
}

/// Refuses a table of `part` that is missing, or lacks one of `columns`: the error
/// names the first column missing and the columns the table has.
#[cfg_attr(not(any(feature = "operator", feature = "rebuild")), allow(dead_code))]
pub(crate) fn require_columns(catalog: &Catalog, part: SchemaPart, columns: &[&str]) -> Result<()> {
    let bare = catalog.table.rsplit('.').next().unwrap_or(&catalog.table);
    let mismatch = |problem, expected, found| Error::SchemaMismatch {
        part,
        problem,
        expected,
        found,
        table: catalog.table.clone(),
    };
    if !catalog.exists {
        return Err(mismatch(
            SchemaProblem::MissingTable,
            format!(
                "table {bare} with column {}",
                columns.first().unwrap_or(&"")
            ),
            "no such table (were the migrations run?)".to_owned(),
        ));
    }
    if let Some(missing) = columns
        .iter()
        .find(|c| !catalog.columns.iter().any(|have| have.name == **c))
    {
        let mut found: Vec<&str> = catalog.columns.iter().map(|c| c.name.as_str()).collect();
        found.sort_unstable();
        return Err(mismatch(
            SchemaProblem::MissingColumn,
            format!("column {missing}"),
            format!("columns {}", found.join(", ")),
        ));
    }
    Ok(())
}

/// An index an operator read needs to stay an index range read (not a scan): its
/// leading columns, in order, and whether it is partial (the predicate itself is
/// not read from the catalog: a partial index with these columns is taken as the
/// migration's).
#[derive(Clone, Copy)]
pub(crate) struct ReadIndex {
    /// The migration's name for it, for the error.
    pub name: &'static str,
    /// Its leading columns, in order.
    pub columns: &'static [&'static str],
    /// Whether it is partial (`WHERE status = 'done'`).
    pub partial: bool,
}

/// Refuses a table of `part` without a valid index whose leading columns are
/// `index.columns` and whose partiality is `index.partial`: the error names the
/// index expected and the table's indexes found.
#[cfg_attr(not(feature = "operator"), allow(dead_code))]
pub(crate) fn require_index(catalog: &Catalog, part: SchemaPart, index: ReadIndex) -> Result<()> {
    let serves = |i: &IndexInfo| {
        i.valid
            && i.partial == index.partial
            && i.columns.len() >= index.columns.len()
            && i.columns
                .iter()
                .zip(index.columns)
                .all(|(have, want)| have.as_deref() == Some(*want))
    };
    if catalog.indexes.iter().any(serves) {
        return Ok(());
    }
    let found: Vec<String> = catalog
        .indexes
        .iter()
        .map(|i| {
            let cols: Vec<&str> = i
                .columns
                .iter()
                .map(|c| c.as_deref().unwrap_or("<expression>"))
                .collect();
            format!(
                "{}{}({}) [{}]",
                if i.valid { "" } else { "invalid " },
                if i.partial { "partial " } else { "" },
                cols.join(", "),
                i.name
            )
        })
        .collect();
    Err(Error::SchemaMismatch {
        part,
        problem: SchemaProblem::MissingIndex,
        expected: format!(
            "{}index {} on ({})",
            if index.partial { "partial " } else { "" },
            index.name,
            index.columns.join(", ")
        ),
        found: if found.is_empty() {
            "no index".to_owned()
        } else {
            format!("indexes {}", found.join(", "))
        },
        table: catalog.table.clone(),
    })
}

/// The one rule for "a unique index enforces exactly this key", for every table that
/// needs it (the claims', the idempotency keys'): the table exists, the key's
/// columns are NOT NULL and compare bytes, one valid, non-deferrable unique index
/// covers exactly the key, and no other unique index can refuse a row the key allows.
pub(crate) fn check_key(catalog: &Catalog, key: Key) -> Result<()> {
    if !catalog.exists {
        return Err(mismatch(
            catalog,
            key,
            SchemaProblem::MissingTable,
            format!("table with unique {}", key.list()),
            "no such table (were the migrations run?)".to_owned(),
        ));
    }
    check_columns(catalog, key)?;
    check_indexes(catalog, key)
}

fn mismatch(
    catalog: &Catalog,
    key: Key,
    problem: SchemaProblem,
    expected: String,
    found: String,
) -> Error {
    Error::SchemaMismatch {
        part: key.part,
        problem,
        expected,
        found,
        table: catalog.table.clone(),
    }
}

/// The key's columns: present, NOT NULL, comparing bytes.
fn check_columns(catalog: &Catalog, key: Key) -> Result<()> {
    let mismatch = |problem, expected, found| mismatch(catalog, key, problem, expected, found);
    for column in key.columns {
        let expected = || format!("NOT NULL column {column} comparing bytes");
        match catalog.columns.iter().find(|c| c.name == *column) {
            None => {
                return Err(mismatch(
                    SchemaProblem::MissingColumn,
                    expected(),
                    "no such column".to_owned(),
                ))
            }
            Some(c) if !c.not_null => {
                return Err(mismatch(
                    SchemaProblem::NullableColumn,
                    expected(),
                    format!("nullable column {column}"),
                ))
            }
            Some(ColumnInfo {
                loose_collation: Some(collation),
                ..
            }) => {
                return Err(mismatch(
                    SchemaProblem::ColumnCollation,
                    expected(),
                    format!("column {column} collate {collation}"),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The unique indexes: one valid, non-deferrable index of exactly the key, and no
/// other that could reject a row the key allows.
fn check_indexes(catalog: &Catalog, key: Key) -> Result<()> {
    let mismatch = |problem, expected, found| mismatch(catalog, key, problem, expected, found);
    let unique: Vec<&IndexInfo> = catalog.indexes.iter().filter(|i| i.unique).collect();
    let found_all = || {
        if unique.is_empty() {
            "no unique index".to_owned()
        } else {
            unique
                .iter()
                .map(|i| describe(i))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    // `ON CONFLICT` takes every unique index on the key's columns as an arbiter and
    // refuses a deferrable one, even initially immediate and beside a good one.
    if let Some(deferrable) = unique.iter().find(|i| i.deferrable && key.same_columns(i)) {
        return Err(mismatch(
            SchemaProblem::DeferrableIndex,
            format!("non-deferrable unique {}", key.list()),
            describe(deferrable),
        ));
    }
    // An invalid index is no arbiter either (a failed CREATE INDEX CONCURRENTLY).
    if !unique.iter().any(|i| key.is_exactly(i) && i.valid) {
        if let Some(invalid) = unique.iter().find(|i| key.is_exactly(i)) {
            return Err(mismatch(
                SchemaProblem::InvalidIndex,
                format!("valid unique {}", key.list()),
                describe(invalid),
            ));
        }
        return Err(mismatch(
            SchemaProblem::NoClaimIndex,
            format!(
                "unique {} without predicate, expression or non-deterministic collation",
                key.list()
            ),
            found_all(),
        ));
    }
    // Another unique index that does not contain the whole key, or folds one of its
    // columns, can reject a row the key allows (a unique message_key makes a second
    // group's claim fail; a case-folding one, a key differing in case), so the
    // insert's conflict and the lookup would disagree.
    if let Some(extra) = unique
        .iter()
        .find(|i| (!key.covered_by(i) && !key.on_generated(i)) || key.folded_by(i))
    {
        return Err(mismatch(
            SchemaProblem::ExtraUniqueIndex,
            format!(
                "no unique index other than on {} or a superset of it",
                key.list()
            ),
            describe(extra),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(name: &str, cols: &[&str], partial: bool) -> IndexInfo {
        IndexInfo {
            name: name.into(),
            unique: true,
            partial,
            deferrable: false,
            valid: true,
            columns: cols
                .iter()
                .map(|c| (*c != "<expr>").then(|| c.to_string()))
                .collect(),
            loose_collations: vec![None; cols.len()],
        }
    }

    fn catalog(indexes: Vec<IndexInfo>) -> Catalog {
        Catalog {
            table: "s.inbox_claims".into(),
            exists: true,
            indexes,
            columns: [
                ("consumer_group", true),
                ("message_key", true),
                ("tenant", false),
            ]
            .into_iter()
            .map(|(name, not_null)| ColumnInfo {
                name: name.into(),
                not_null,
                loose_collation: None,
                type_name: "text".into(),
            })
            .collect(),
        }
    }

    #[test]
    fn accepts_the_key_in_any_order_and_supersets() {
        let ok = catalog(vec![
            index("pk", &["message_key", "consumer_group"], false),
            index("wide", &["consumer_group", "message_key", "tenant"], false),
        ]);
        check(&ok).unwrap();
    }

    #[test]
    fn names_what_it_expected_and_found() {
        let err = check(&catalog(vec![index(
            "t",
            &["tenant", "message_key"],
            false,
        )]))
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "claim index mismatch: expected unique (consumer_group, message_key) without \
             predicate, expression or non-deterministic collation, found unique \
             (tenant, message_key) [t] on s.inbox_claims"
        );
    }

    #[test]
    fn refuses_a_case_folding_collation_and_names_it() {
        let mut folded = index("pk", &["consumer_group", "message_key"], false);
        folded.loose_collations[1] = Some("NOCASE".into());
        let err = check(&catalog(vec![folded])).unwrap_err().to_string();
        assert!(
            err.contains("found unique (consumer_group, message_key collate NOCASE) [pk]"),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_case_folding_index_beside_the_claim_key() {
        let mut folded = index("folded", &["consumer_group", "message_key"], false);
        folded.loose_collations[1] = Some("NOCASE".into());
        let pk = index("pk", &["message_key", "consumer_group"], false);
        let err = check(&catalog(vec![pk, folded])).unwrap_err().to_string();
        assert!(
            err.contains("found unique (consumer_group, message_key collate NOCASE) [folded]"),
            "{err}"
        );
        // Folding a column outside the claim key folds nothing the key compares.
        let mut wide = index("wide", &["consumer_group", "message_key", "tenant"], false);
        wide.loose_collations[2] = Some("NOCASE".into());
        let pk = index("pk", &["message_key", "consumer_group"], false);
        check(&catalog(vec![pk, wide])).unwrap();
    }

    fn refusal(catalog: &Catalog) -> (SchemaProblem, String) {
        match check(catalog) {
            Err(err @ Error::SchemaMismatch { problem, .. }) => (problem, err.to_string()),
            other => panic!("expected a schema mismatch, got {other:?}"),
        }
    }

    #[test]
    fn refuses_a_lone_superset_of_the_key() {
        // ON CONFLICT (consumer_group, message_key) has no arbiter on a wider index.
        let wide = index("wide", &["consumer_group", "message_key", "tenant"], false);
        let (problem, err) = refusal(&catalog(vec![wide]));
        assert_eq!(problem, SchemaProblem::NoClaimIndex, "{err}");
        assert!(
            err.contains("found unique (consumer_group, message_key, tenant) [wide]"),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_deferrable_key_alone_or_beside_a_good_one() {
        let mut deferred = index(
            "inbox_claims_pkey",
            &["consumer_group", "message_key"],
            false,
        );
        deferred.deferrable = true;
        let (problem, err) = refusal(&catalog(vec![deferred]));
        assert_eq!(problem, SchemaProblem::DeferrableIndex, "{err}");
        assert_eq!(
            err,
            "claim index mismatch: expected non-deferrable unique (consumer_group, \
             message_key), found deferrable unique (consumer_group, message_key) \
             [inbox_claims_pkey] on s.inbox_claims"
        );
        // ON CONFLICT takes both as arbiters and refuses the deferrable one.
        let mut beside = index("d", &["message_key", "consumer_group"], false);
        beside.deferrable = true;
        let pk = index("pk", &["consumer_group", "message_key"], false);
        let (problem, err) = refusal(&catalog(vec![pk, beside]));
        assert_eq!(problem, SchemaProblem::DeferrableIndex, "{err}");
        assert!(err.contains("found deferrable unique (message_key, consumer_group) [d]"));
        // A deferrable superset is no arbiter and cannot reject what the key allows.
        let mut wide = index("wide", &["consumer_group", "message_key", "tenant"], false);
        wide.deferrable = true;
        let pk = index("pk", &["consumer_group", "message_key"], false);
        check(&catalog(vec![pk, wide])).unwrap();
    }

    #[test]
    fn refuses_an_invalid_key_index() {
        let mut invalid = index("claim", &["consumer_group", "message_key"], false);
        invalid.valid = false;
        let (problem, err) = refusal(&catalog(vec![invalid]));
        assert_eq!(problem, SchemaProblem::InvalidIndex, "{err}");
        assert!(
            err.contains(
                "expected valid unique (consumer_group, message_key), \
                 found invalid unique (consumer_group, message_key) [claim]"
            ),
            "{err}"
        );
        // A leftover invalid copy beside a valid key index is no arbiter and harmless.
        let mut leftover = index("claim_ccnew", &["consumer_group", "message_key"], false);
        leftover.valid = false;
        let pk = index("pk", &["message_key", "consumer_group"], false);
        check(&catalog(vec![pk, leftover])).unwrap();
    }

    #[test]
    fn refuses_a_case_folding_key_column() {
        let mut folded = catalog(vec![index("pk", &["consumer_group", "message_key"], false)]);
        folded.columns[1].loose_collation = Some("NOCASE".into());
        let (problem, err) = refusal(&folded);
        assert_eq!(problem, SchemaProblem::ColumnCollation, "{err}");
        assert!(
            err.contains("found column message_key collate NOCASE"),
            "{err}"
        );
    }

    #[test]
    fn refuses_expressions_partials_and_subsets() {
        for bad in [
            vec![index("e", &["consumer_group", "<expr>"], false)],
            vec![index("p", &["consumer_group", "message_key"], true)],
            vec![
                index("pk", &["consumer_group", "message_key"], false),
                index("k", &["message_key"], false),
            ],
            vec![],
        ] {
            assert!(check(&catalog(bad)).is_err());
        }
    }

    /// A unique index on a column the database generates refuses no row the key
    /// allows; on any other column outside the key, it does.
    #[test]
    fn a_unique_index_on_a_generated_column_is_no_extra_key() {
        let mut c = catalog(vec![
            index("pk", &["id"], false),
            index("key", &["consumer_group", "message_key"], false),
        ]);
        let key = Key {
            generated: &["id"],
            ..CLAIMS
        };
        check_key(&c, key).unwrap();
        match check(&c) {
            Err(Error::SchemaMismatch {
                problem: SchemaProblem::ExtraUniqueIndex,
                found,
                ..
            }) => assert_eq!(found, "unique (id) [pk]"),
            other => panic!("{other:?}"),
        }
        // A generated column does not excuse an index that folds a key column.
        c.indexes[0] = index("pk", &["id", "message_key"], false);
        c.indexes[0].loose_collations = vec![None, Some("nocase".into())];
        assert!(check_key(&c, key).is_err());
    }

    #[test]
    fn required_columns_name_the_first_missing_and_what_is_there() {
        let c = catalog(vec![]);
        require_columns(&c, SchemaPart::Rebuild, &["consumer_group", "message_key"]).unwrap();
        match require_columns(&c, SchemaPart::Rebuild, &["message_key", "covered_at"]) {
            Err(Error::SchemaMismatch {
                part: SchemaPart::Rebuild,
                problem: SchemaProblem::MissingColumn,
                expected,
                found,
                table,
            }) => {
                assert_eq!(expected, "column covered_at");
                assert_eq!(found, "columns consumer_group, message_key, tenant");
                assert_eq!(table, "s.inbox_claims");
            }
            other => panic!("{other:?}"),
        }
        let gone = Catalog {
            exists: false,
            columns: vec![],
            ..catalog(vec![])
        };
        match require_columns(&gone, SchemaPart::Operator, &["run_id", "seq"]) {
            Err(Error::SchemaMismatch {
                problem: SchemaProblem::MissingTable,
                expected,
                found,
                ..
            }) => {
                assert_eq!(expected, "table inbox_claims with column run_id");
                assert!(found.starts_with("no such table"), "{found}");
            }
            other => panic!("{other:?}"),
        }
    }
}
