//! PostgreSQL's side of the operator tooling: its statements (the shared DSL of
//! `operator::ops`).

use diesel::prelude::*;
use diesel::result::QueryResult;

use chrono::{DateTime, Utc};

use crate::operator::ops::{EntryRow, FailureCount, FailureSample, OperatorOps, Redrivable};
use crate::operator::{DeadLetterFilter, LetterStatus};

crate::operator::operator_ops!(diesel::PgConnection);
