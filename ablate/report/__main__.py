"""python -m ablate.report <results path>: (re)write report.md and the figures of each run below it."""
from ablate.report.page import main

main()
