"""The ``humming`` backend (:mod:`.backend`, registered on first use), its adapter to the humming
library (:mod:`.library`, imported lazily) and the shipped tuning tables (:mod:`.tuning`)."""
