DROP TABLE inbox_rebuild_reports;
