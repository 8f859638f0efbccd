DROP TABLE inbox_dead_letters;
DROP TABLE inbox_claims;
