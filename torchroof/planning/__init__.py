"""Plans: the layouts a plan search picks from, and the files and commands that run one."""
