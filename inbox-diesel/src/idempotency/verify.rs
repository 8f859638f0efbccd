//! The idempotency table's unique index must enforce exactly (caller,
//! idempotency_key): the insert's conflict and the lookup by key must agree, or two
//! requests with one key could both execute (a missing or partial index) or one
//! key's request could refuse another's (a unique index on a part of the key).

use super::IDEMPOTENCY_KEY_COLUMNS as KEY;
use crate::verify::{check_key, Catalog, Key};
use crate::{Error, Result, SchemaPart, SchemaProblem};

/// Refuses an idempotency table whose unique indexes do not enforce exactly the key:
/// the claim table's rule ([`check_key`]), with (caller, idempotency_key).
pub(crate) fn check(catalog: &Catalog) -> Result<()> {
    check_key(
        catalog,
        Key {
            part: SchemaPart::Idempotency,
            columns: &KEY,
            generated: &[],
        },
    )
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
    use crate::verify::IndexInfo;

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
                    type_name: "text".into(),
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
            "idempotency index mismatch: expected unique (caller, idempotency_key) \
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
