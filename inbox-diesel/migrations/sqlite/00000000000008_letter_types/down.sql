-- The queue names the letters carried before are not restored: they named no type.
SELECT 1;
