DROP TABLE inbox_replay_sequences;
