"""Files in and out: the formats (counts and placements in every engine's form) and the reports."""
