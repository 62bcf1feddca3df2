/* commands.h: the `caraserve` subcommands, one cmd_*.c each. */
#ifndef CS_COMMANDS_H
#define CS_COMMANDS_H

int cmd_generate(int argc, char **argv);
int cmd_batch(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_router(int argc, char **argv);
/* serve's --config FILE as argv words ("--name", "value"; *words and each word malloc'd, also
 * on failure): 0, or -1 with the reason (file:line) on stderr */
int serve_read_config(const char *path, char ***words, int *n);

#endif
