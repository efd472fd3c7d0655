"""Embedded tasks: everything a demo or test run needs is built in code — nothing is downloaded."""
