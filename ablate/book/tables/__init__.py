"""The analytic tables the chapter experiments print beside what they measured, one module per
chapter (each has `analytic_tables(config, summary) -> {heading: table}`), registered in
ablate/book/chapter_tables.py."""
