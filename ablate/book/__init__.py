"""The chapter, claim by claim: each quantitative statement of the book's chapter 7 beside the
project's computed or measured figure and a verdict (`python -m ablate book`), and the analytic
tables the chapter experiments print beside what they measure (tables/, registered in
chapter_tables.py: the report and the jobs read them through analytic_tables)."""
