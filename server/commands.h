/* commands.h: the `caraserve` subcommands, one cmd_*.c each. */
#ifndef CS_COMMANDS_H
#define CS_COMMANDS_H

int cmd_generate(int argc, char **argv);
int cmd_batch(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_router(int argc, char **argv);

#endif
