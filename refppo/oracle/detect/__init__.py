"""``--detect``: every convention that reproduces a dump, searched stage by stage (:mod:`.detection`)."""
