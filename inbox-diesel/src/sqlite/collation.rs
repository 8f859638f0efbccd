//! Column collations, read from the table's CREATE statement.
//!
//! SQLite has no pragma for a column's declared collation (`table_xinfo` leaves it
//! out, `index_xinfo` gives an index's, which may name its own). The statement in
//! `sqlite_master` is the text SQLite itself parses whenever it loads the schema
//! (`ALTER TABLE` rewrites it), so the collation is read from there: by tokens, the
//! way SQLite splits them, so that comments, quoted names and a `COLLATE` inside a
//! `CHECK` or `DEFAULT` expression are not mistaken for a column's.

/// A token of SQLite's SQL, as far as a column list needs.
#[derive(Debug, PartialEq)]
enum Token<'a> {
    /// A bare word: a keyword or an unquoted name.
    Word(&'a str),
    /// A quoted name or string literal (SQLite takes either as a name here),
    /// unescaped.
    Quoted(String),
    Open,
    Close,
    Comma,
    Other,
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$' || !c.is_ascii()
}

/// The text of a token quoted by `quote` at the start of `sql` (a doubled quote
/// stands for itself), and the token's length in bytes.
fn quoted(sql: &str, quote: char) -> (String, usize) {
    let mut text = String::new();
    let mut chars = sql.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        if c == quote {
            if chars.peek().is_some_and(|&(_, next)| next == quote) {
                chars.next();
            } else {
                return (text, i + c.len_utf8());
            }
        }
        text.push(c);
    }
    (text, sql.len())
}

fn tokens(sql: &str) -> Vec<Token<'_>> {
    let mut out = Vec::new();
    let mut rest = sql;
    while let Some(c) = rest.chars().next() {
        let (token, len) = match c {
            '-' if rest.starts_with("--") => (None, rest.find('\n').unwrap_or(rest.len())),
            '/' if rest.starts_with("/*") => {
                (None, rest[2..].find("*/").map_or(rest.len(), |end| end + 4))
            }
            '\'' | '"' | '`' => {
                let (text, len) = quoted(rest, c);
                (Some(Token::Quoted(text)), len)
            }
            '[' => match rest.find(']') {
                Some(end) => (Some(Token::Quoted(rest[1..end].to_owned())), end + 1),
                None => (Some(Token::Quoted(rest[1..].to_owned())), rest.len()),
            },
            '(' => (Some(Token::Open), 1),
            ')' => (Some(Token::Close), 1),
            ',' => (Some(Token::Comma), 1),
            c if is_word(c) => {
                let len = rest.find(|c| !is_word(c)).unwrap_or(rest.len());
                (Some(Token::Word(&rest[..len])), len)
            }
            c => ((!c.is_whitespace()).then_some(Token::Other), c.len_utf8()),
        };
        out.extend(token);
        rest = &rest[len..];
    }
    out
}

fn is_keyword(token: &Token<'_>, keyword: &str) -> bool {
    matches!(token, Token::Word(word) if word.eq_ignore_ascii_case(keyword))
}

fn name(token: &Token<'_>) -> Option<String> {
    match token {
        Token::Word(word) => Some((*word).to_owned()),
        Token::Quoted(text) => Some(text.clone()),
        _ => None,
    }
}

/// Every column of a `CREATE TABLE` statement that declares a collation, with it:
/// (column, collation), as written. A table made `AS SELECT` declares none.
pub(crate) fn declared(create_table: &str) -> Vec<(String, String)> {
    let tokens = tokens(create_table);
    let Some(open) = tokens.iter().position(|t| *t == Token::Open) else {
        return vec![];
    };
    if tokens[..open].iter().any(|t| is_keyword(t, "AS")) {
        return vec![];
    }
    // The column list's items, each as its tokens outside any parentheses (a
    // CHECK, a DEFAULT or generated expression, a REFERENCES column list).
    let mut items: Vec<Vec<&Token<'_>>> = vec![vec![]];
    let mut depth = 0usize;
    for token in &tokens[open + 1..] {
        match token {
            Token::Open => depth += 1,
            Token::Close if depth == 0 => break,
            Token::Close => depth -= 1,
            Token::Comma if depth == 0 => items.push(vec![]),
            token if depth == 0 => items.last_mut().into_iter().for_each(|i| i.push(token)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for item in items {
        let Some((first, rest)) = item.split_first() else {
            continue;
        };
        // A table constraint starts with a reserved word, which no bare column name
        // can be.
        if ["CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN"]
            .iter()
            .any(|k| is_keyword(first, k))
        {
            continue;
        }
        let Some(column) = name(first) else { continue };
        // The last COLLATE clause wins, as in SQLite.
        let collation = rest
            .windows(2)
            .filter(|pair| is_keyword(pair[0], "COLLATE"))
            .filter_map(|pair| name(pair[1]))
            .next_back();
        if let Some(collation) = collation {
            out.push((column, collation));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::connection::SimpleConnection;
    use diesel::prelude::*;
    use diesel::sql_types::{Integer, Text};
    use diesel::SqliteConnection;

    const TRICKY: &str = r#"CREATE TABLE "inbox claims" ( -- a comment, with ( and COLLATE x
        consumer_group TEXT NOT NULL CHECK (consumer_group <> 'x' COLLATE NOCASE),
        [message_key] TEXT /* COLLATE RTRIM */ NOT NULL COLLATE "NOCASE",
        `odd ""name` TEXT DEFAULT ('a' COLLATE NOCASE) collate rtrim,
        "say ""hi""" TEXT COLLATE NOCASE COLLATE BINARY,
        plain TEXT,
        'quoted' TEXT COLLATE nocase,
        CONSTRAINT pk PRIMARY KEY (message_key COLLATE BINARY, consumer_group),
        UNIQUE (plain COLLATE NOCASE),
        CHECK (plain COLLATE NOCASE <> 'y')
    )"#;

    #[test]
    fn reads_each_columns_own_collation_only() {
        assert_eq!(
            declared(TRICKY),
            [
                ("message_key", "NOCASE"),
                ("odd \"\"name", "rtrim"),
                ("say \"hi\"", "BINARY"),
                ("quoted", "nocase"),
            ]
            .map(|(c, k)| (c.to_owned(), k.to_owned()))
        );
        assert!(declared("CREATE TABLE t AS SELECT 'a' COLLATE NOCASE AS x").is_empty());
        assert!(declared("CREATE TABLE t (a TEXT COLLATE").is_empty());
    }

    #[derive(QueryableByName)]
    struct Folds {
        #[diesel(sql_type = Integer)]
        folds: i32,
    }

    #[derive(QueryableByName)]
    struct Sql {
        #[diesel(sql_type = Text)]
        sql: String,
    }

    /// What SQLite does agrees with what is read: a column compares 'a' and 'A ' as
    /// equal exactly when it declares NOCASE or RTRIM (and 'A' = 'a' only for NOCASE).
    #[test]
    fn agrees_with_sqlite_on_the_stored_statement() {
        let mut conn = SqliteConnection::establish(":memory:").unwrap();
        conn.batch_execute(TRICKY).unwrap();
        conn.batch_execute("ALTER TABLE \"inbox claims\" ADD COLUMN added TEXT COLLATE NOCASE")
            .unwrap();
        let stored: Sql = diesel::sql_query("SELECT sql FROM sqlite_master WHERE type = 'table'")
            .get_result(&mut conn)
            .unwrap();
        let declared = declared(&stored.sql);
        for column in [
            "consumer_group",
            "message_key",
            "odd \"\"name",
            "say \"hi\"",
            "plain",
            "quoted",
            "added",
        ] {
            let quoted = column.replace('"', "\"\"");
            let probe: Folds = diesel::sql_query(format!(
                "SELECT (x = 'A') + 2 * (x = 'a ') AS folds \
                 FROM (SELECT \"{quoted}\" AS x FROM \"inbox claims\" WHERE 0 \
                       UNION ALL SELECT 'a')"
            ))
            .get_result(&mut conn)
            .unwrap();
            let read = declared
                .iter()
                .find(|(c, _)| c == column)
                .map(|(_, k)| k.to_ascii_uppercase());
            let expected = match probe.folds {
                0 => None,
                1 => Some("NOCASE"),
                2 => Some("RTRIM"),
                other => panic!("{column}: {other}"),
            };
            assert_eq!(
                read.as_deref().filter(|k| *k != "BINARY"),
                expected,
                "{column} in {}",
                stored.sql
            );
        }
    }
}
