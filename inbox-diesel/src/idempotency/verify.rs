//! The idempotency table's unique index must enforce exactly (caller,
//! idempotency_key): the insert's conflict and the lookup by key must agree, or two
//! requests with one key could both execute (a missing or partial index) or one
//! key's request could refuse another's (a unique index on a part of the key).

use super::IDEMPOTENCY_KEY_COLUMNS as KEY;
use crate::verify::{describe, Catalog, IndexInfo};
use crate::{Error, Result, SchemaProblem};

fn key_list() -> String {
    format!("({})", KEY.join(", "))
}

fn covers_key(index: &IndexInfo) -> bool {
    KEY.iter()
        .all(|k| index.columns.iter().any(|c| c.as_deref() == Some(*k)))
}

fn same_columns(index: &IndexInfo) -> bool {
    index.columns.len() == KEY.len() && covers_key(index)
}

fn folds_key(index: &IndexInfo) -> bool {
    index
        .columns
        .iter()
        .zip(&index.loose_collations)
        .any(|(c, loose)| loose.is_some() && c.as_deref().is_some_and(|c| KEY.contains(&c)))
}

fn is_key_index(index: &IndexInfo) -> bool {
    index.unique
        && !index.partial
        && !index.deferrable
        && index.valid
        && !folds_key(index)
        && same_columns(index)
}

/// Refuses an idempotency table whose unique indexes do not enforce exactly the key.
pub(crate) fn check(catalog: &Catalog) -> Result<()> {
    let mismatch =
        |problem: SchemaProblem, expected: String, found: String| Error::SchemaMismatch {
            part: crate::SchemaPart::Idempotency,
            problem,
            expected,
            found,
            table: catalog.table.clone(),
        };
    if !catalog.exists {
        return Err(mismatch(
            SchemaProblem::MissingTable,
            format!("table with unique {}", key_list()),
            "no such table (were the migrations run?)".to_owned(),
        ));
    }
    for key in KEY {
        let expected = || format!("NOT NULL column {key} comparing bytes");
        match catalog.columns.iter().find(|c| c.name == key) {
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
                    format!("nullable column {key}"),
                ))
            }
            Some(c) => {
                if let Some(collation) = &c.loose_collation {
                    return Err(mismatch(
                        SchemaProblem::ColumnCollation,
                        expected(),
                        format!("column {key} collate {collation}"),
                    ));
                }
            }
        }
    }
    let unique: Vec<&IndexInfo> = catalog.indexes.iter().filter(|i| i.unique).collect();
    if let Some(deferrable) = unique.iter().find(|i| i.deferrable && same_columns(i)) {
        return Err(mismatch(
            SchemaProblem::DeferrableIndex,
            format!("non-deferrable unique {}", key_list()),
            describe(deferrable),
        ));
    }
    if !unique.iter().any(|i| is_key_index(i)) {
        let found = if unique.is_empty() {
            "no unique index".to_owned()
        } else {
            unique
                .iter()
                .map(|i| describe(i))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let problem = if unique.iter().any(|i| same_columns(i) && !i.valid) {
            SchemaProblem::InvalidIndex
        } else {
            SchemaProblem::NoClaimIndex
        };
        return Err(mismatch(
            problem,
            format!(
                "valid unique {} without predicate, expression or non-deterministic collation",
                key_list()
            ),
            found,
        ));
    }
    if let Some(extra) = unique.iter().find(|i| !covers_key(i) || folds_key(i)) {
        return Err(mismatch(
            SchemaProblem::ExtraUniqueIndex,
            format!(
                "no unique index other than on {} or a superset of it",
                key_list()
            ),
            describe(extra),
        ));
    }
    Ok(())
}

/// Refuses a `lease_token` column of another type than `expected` (an integer
/// counter of a schema before the migration `random_lease_tokens`).
pub(crate) fn check_token_type(table: &str, found: Option<String>, expected: &str) -> Result<()> {
    let problem = match &found {
        None => SchemaProblem::MissingColumn,
        Some(t) if t == expected => return Ok(()),
        Some(_) => SchemaProblem::ColumnType,
    };
    Err(Error::SchemaMismatch {
        part: crate::SchemaPart::Idempotency,
        problem,
        expected: format!("column lease_token of type {expected} (16 random bytes)"),
        found: match found {
            None => "no such column".to_owned(),
            Some(t) => format!("column lease_token of type {t}"),
        },
        table: table.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::ColumnInfo;

    fn index(name: &str, cols: &[&str]) -> IndexInfo {
        IndexInfo {
            name: name.into(),
            unique: true,
            partial: false,
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
            table: "s.idempotency_keys".into(),
            exists: true,
            indexes,
            columns: ["caller", "idempotency_key", "status"]
                .into_iter()
                .map(|name| ColumnInfo {
                    name: name.into(),
                    not_null: true,
                    loose_collation: None,
                })
                .collect(),
        }
    }

    fn problem(catalog: &Catalog) -> SchemaProblem {
        match check(catalog) {
            Err(Error::SchemaMismatch {
                part: crate::SchemaPart::Idempotency,
                problem,
                ..
            }) => problem,
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    #[test]
    fn accepts_the_key_in_any_order_beside_a_superset() {
        check(&catalog(vec![index("pk", &["idempotency_key", "caller"])])).unwrap();
        check(&catalog(vec![
            index("pk", &["caller", "idempotency_key"]),
            index("wide", &["caller", "idempotency_key", "status"]),
        ]))
        .unwrap();
    }

    #[test]
    fn refuses_what_would_let_two_requests_with_one_key_run_or_refuse_another() {
        let err = check(&catalog(vec![index("k", &["idempotency_key"])]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "idempotency index mismatch: expected valid unique (caller, idempotency_key) \
             without predicate, expression or non-deterministic collation, found unique \
             (idempotency_key) [k] on s.idempotency_keys"
        );
        assert_eq!(problem(&catalog(vec![])), SchemaProblem::NoClaimIndex);
        let mut partial = index("p", &["caller", "idempotency_key"]);
        partial.partial = true;
        assert_eq!(
            problem(&catalog(vec![partial])),
            SchemaProblem::NoClaimIndex
        );
        let mut deferred = index("d", &["caller", "idempotency_key"]);
        deferred.deferrable = true;
        assert_eq!(
            problem(&catalog(vec![deferred])),
            SchemaProblem::DeferrableIndex
        );
        let mut invalid = index("i", &["caller", "idempotency_key"]);
        invalid.valid = false;
        assert_eq!(
            problem(&catalog(vec![invalid])),
            SchemaProblem::InvalidIndex
        );
        let mut folded = index("f", &["caller", "idempotency_key"]);
        folded.loose_collations[1] = Some("NOCASE".into());
        assert_eq!(problem(&catalog(vec![folded])), SchemaProblem::NoClaimIndex);
        assert_eq!(
            problem(&catalog(vec![
                index("pk", &["caller", "idempotency_key"]),
                index("k", &["idempotency_key"]),
            ])),
            SchemaProblem::ExtraUniqueIndex
        );
        assert_eq!(
            problem(&catalog(vec![index("e", &["caller", "<expr>"])])),
            SchemaProblem::NoClaimIndex
        );
    }

    #[test]
    fn refuses_a_lease_token_that_is_not_bytes() {
        check_token_type("t", Some("bytea".into()), "bytea").unwrap();
        let err = check_token_type("t", Some("bigint".into()), "bytea").unwrap_err();
        assert_eq!(
            err.to_string(),
            "idempotency index mismatch: expected column lease_token of type bytea \
             (16 random bytes), found column lease_token of type bigint on t"
        );
        assert!(matches!(
            err,
            Error::SchemaMismatch {
                part: crate::SchemaPart::Idempotency,
                problem: SchemaProblem::ColumnType,
                ..
            }
        ));
        assert!(matches!(
            check_token_type("t", None, "blob"),
            Err(Error::SchemaMismatch {
                part: crate::SchemaPart::Idempotency,
                problem: SchemaProblem::MissingColumn,
                ..
            })
        ));
    }

    #[test]
    fn refuses_a_missing_table_or_a_weak_column() {
        let mut missing = catalog(vec![]);
        missing.exists = false;
        assert_eq!(problem(&missing), SchemaProblem::MissingTable);
        let mut nullable = catalog(vec![index("pk", &["caller", "idempotency_key"])]);
        nullable.columns[0].not_null = false;
        assert_eq!(problem(&nullable), SchemaProblem::NullableColumn);
        let mut loose = catalog(vec![index("pk", &["caller", "idempotency_key"])]);
        loose.columns[1].loose_collation = Some("und-ci".into());
        assert_eq!(problem(&loose), SchemaProblem::ColumnCollation);
        let mut gone = catalog(vec![index("pk", &["caller", "idempotency_key"])]);
        gone.columns.remove(0);
        assert_eq!(problem(&gone), SchemaProblem::MissingColumn);
    }
}
