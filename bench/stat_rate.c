/* stat rate of N files in one directory, for the idle-stat measurement of
 * docs/BENCHMARKS.md ("Warm trees stay warm").
 *
 *   gcc -O2 -pthread -o stat_rate bench/stat_rate.c
 *   stat_rate DIR N THREADS PASSES [create]
 *
 * With "create", makes DIR and the files f0..f{N-1} first (open O_CREAT|O_EXCL, close;
 * untimed). Then THREADS threads stat the files (thread t takes every THREADS-th one),
 * PASSES times over, and the rate is printed as "T threads: R stat/s". */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *base;
static int files, threads, passes;

static void *worker(void *arg) {
  long t = (long)arg;
  char path[4096];
  struct stat st;
  for (int pass = 0; pass < passes; pass++)
    for (int i = t; i < files; i += threads) {
      snprintf(path, sizeof path, "%s/f%d", base, i);
      if (stat(path, &st) != 0) {
        perror(path);
        exit(1);
      }
    }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 5 || atoi(argv[3]) < 1 || atoi(argv[3]) > 64) {
    fprintf(stderr, "usage: %s DIR N THREADS(1-64) PASSES [create]\n", argv[0]);
    return 2;
  }
  base = argv[1];
  files = atoi(argv[2]);
  threads = atoi(argv[3]);
  passes = atoi(argv[4]);
  char path[4096];
  if (argc > 5) {
    if (mkdir(base, 0755) != 0) {
      perror(base);
      return 1;
    }
    for (int i = 0; i < files; i++) {
      snprintf(path, sizeof path, "%s/f%d", base, i);
      int fd = open(path, O_CREAT | O_WRONLY | O_EXCL, 0644);
      if (fd < 0) {
        perror(path);
        return 1;
      }
      close(fd);
    }
  }
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  pthread_t workers[64];
  for (long t = 0; t < threads; t++)
    pthread_create(&workers[t], NULL, worker, (void *)t);
  for (int t = 0; t < threads; t++)
    pthread_join(workers[t], NULL);
  clock_gettime(CLOCK_MONOTONIC, &end);
  double seconds = (end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) / 1e9;
  printf("%d threads: %.0f stat/s\n", threads, (double)files * passes / seconds);
  return 0;
}
